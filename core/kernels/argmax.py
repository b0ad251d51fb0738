"""Row-wise argmax of logits in two launches: the greedy choice of a decode step.

``argmax(x, out=None)`` for ``x`` ``[rows, n]`` (any float dtype, contiguous last dim) returns int64
``[rows]`` with ``torch.argmax``'s answer: the first index of the largest value, a NaN counting as larger
than any number (the first NaN wins), index 0 for a row of ``-inf``.

Why not ``torch.argmax``: on one row of a 129k-248k vocabulary it runs one reduction whose blocks meet
through global memory: 28 µs on an H200 for half a megabyte, 1.5% of a DeepSeek-V3 4-layer decode step,
where these two launches take 3 µs (``bench/profile_decode.py --model deepseek``, 2026-12-04).
Here each row is cut into chunks that fill the GPU; each program keeps, per lane, the best (value, index)
of its chunk and writes the chunk's best; a second launch picks each row's best of its chunks. Sizes
depend on the shape only (no host sync): graph-safe.
"""

from __future__ import annotations

import torch

from pegainfer.kernels._triton import next_pow2, num_sms, tl, triton

#: Elements a program reads per iteration.
BLOCK = 1024


@triton.jit
def _best(value, index, BIG: tl.constexpr):
    """The (value, index) of the first maximum, a NaN above all, over a vector whose empty lanes hold
    (-inf, BIG)."""
    is_nan = value != value
    any_nan = tl.max(is_nan.to(tl.int32), 0) > 0
    top = tl.max(tl.where(is_nan, float("-inf"), value), 0)
    first_top = tl.min(tl.where(value == top, index, BIG), 0)
    first_nan = tl.min(tl.where(is_nan, index, BIG), 0)
    return tl.where(any_nan, float("nan"), top), tl.where(any_nan, first_nan, first_top)


@triton.jit
def _argmax_chunk_kernel(
    x_ptr, part_val_ptr, part_idx_ptr, n, stride_x, chunk, CHUNKS: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    start = part * chunk
    end = tl.minimum(start + chunk, n)
    BIG: tl.constexpr = 2**62
    best_v = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.full([BLOCK], BIG, tl.int64)
    for off in range(start, end, BLOCK):
        offs = off + tl.arange(0, BLOCK)
        valid = offs < end
        v = tl.load(x_ptr + row * stride_x + offs, mask=valid, other=float("-inf")).to(tl.float32)
        v_nan = v != v
        b_nan = best_v != best_v
        # Lanes see increasing indices, so a tie keeps the earlier one unless the lane is still empty.
        better = (v > best_v) | ((v == best_v) & (best_i == BIG)) | (v_nan & ~b_nan)
        better = better & valid
        best_v = tl.where(better, v, best_v)
        best_i = tl.where(better, offs.to(tl.int64), best_i)
    top, index = _best(best_v, best_i, BIG)
    tl.store(part_val_ptr + row * CHUNKS + part, top)
    tl.store(part_idx_ptr + row * CHUNKS + part, index)


@triton.jit
def _argmax_rows_kernel(part_val_ptr, part_idx_ptr, out_ptr, CHUNKS: tl.constexpr, BLOCK_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    BIG: tl.constexpr = 2**62
    offs = tl.arange(0, BLOCK_C)
    valid = offs < CHUNKS
    v = tl.load(part_val_ptr + row * CHUNKS + offs, mask=valid, other=float("-inf"))
    i = tl.load(part_idx_ptr + row * CHUNKS + offs, mask=valid, other=BIG)
    _, index = _best(v, i, BIG)
    tl.store(out_ptr + row, index)


def argmax_chunks(rows: int, n: int, sms: int) -> int:
    """Chunks a row is cut into: about two programs per multiprocessor over the whole launch, each at
    least one ``BLOCK``."""
    return max(1, min(triton.cdiv(n, BLOCK), triton.cdiv(2 * sms, max(1, rows))))


def argmax(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """See the module docstring; ``out`` (int64 ``[rows]``, contiguous) is written and returned when given."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"argmax takes [rows, n] with a contiguous last dim, got {tuple(x.shape)}")
    rows, n = x.shape
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if out.shape != (rows,) or out.dtype != torch.int64 or not out.is_contiguous():
        raise ValueError(f"out must be contiguous int64 [{rows}], got {out.dtype} {tuple(out.shape)}")
    if rows == 0:
        return out
    if n == 0:
        raise ValueError("argmax of an empty row")
    chunks = argmax_chunks(rows, n, num_sms(x.device))
    chunk = triton.cdiv(triton.cdiv(n, chunks), BLOCK) * BLOCK
    chunks = triton.cdiv(n, chunk)  # rounding the chunk up may leave fewer
    part_val = torch.empty(rows, chunks, dtype=torch.float32, device=x.device)
    part_idx = torch.empty(rows, chunks, dtype=torch.int64, device=x.device)
    _argmax_chunk_kernel[(rows, chunks)](
        x, part_val, part_idx, n, x.stride(0), chunk, CHUNKS=chunks, BLOCK=BLOCK, num_warps=4
    )
    _argmax_rows_kernel[(rows,)](
        part_val, part_idx, out, CHUNKS=chunks, BLOCK_C=next_pow2(chunks), num_warps=1
    )
    return out
