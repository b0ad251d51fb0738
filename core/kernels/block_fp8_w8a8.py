"""Block-FP8 GEMM on the FP8 tensor cores (W8A8): ``y = x @ w.T`` for a float8 weight with per-row tile
scales (``pegainfer.layers.block_fp8.BlockFP8Weight``), the activations quantized per token and per
group of columns that shares one weight tile, beside its torch reference ``block_fp8_linear_ref(...,
fp8_activations=True)``.

Both operands enter the MMA as float8, straight from shared memory: nothing widens the weight in
registers (the W8A16 kernel, ``block_fp8_gemm``, does, and measured at 38-78% of the read rate at batch
1 where bf16 weights stream at ~93%). Each tile's fp32 partial sum is scaled by the weight row's tile
scale and the activation row's group scale before it joins the accumulator: every 128-column product
is promoted to fp32 at once, as DeepSeek-V3's report prescribes for Hopper's FP8 accumulation.

x is quantized first by :func:`quantize_activations` (one pass over x, one launch) and the loop streams
float8 tiles of both. The first form quantized each x tile inside the loop (no launch added), as did
the skinny GEMM's stream-K W8A8 form and the experts' pair path beside it: DeepSeek-V3's FP8 step at
batch 1 took 5.47 ms on an H100 against W8A16's 1.85 in the same call (4f1c1e8 vs 9a7e995, records in
``bench/results/deepseek.jsonl``), so those forms were removed; why they lost (each tile's reduction,
division and conversion between its loads and the tensor cores is the suspect) was not measured.

As in the skinny GEMM, ``w`` is the wide operand (``[BLOCK_N, QBLOCK] @ [QBLOCK, BLOCK_M]``, a quantization
tile's columns a step), and the epilogue is the skinny GEMM's: bias, SiLU·mul of interleaved gate|up rows, the
residual add in place. A weight whose columns start inside a tile (a shard, ``offset``) quantizes x in
groups on the weight's tile grid: the loop steps over whole tiles from column ``-offset``.
"""

from __future__ import annotations

import torch

from pegainfer.kernels._triton import interp_bf16, interpreting, num_sms, tl, triton
from pegainfer.kernels.act_quant import check_fp8_mma, dot_fp8, quantize_activations
from pegainfer.kernels.block_fp8_gemm import gemm_operands
from pegainfer.kernels.skinny_gemm import scale_rows, tile_epilogue
from pegainfer.layers.block_fp8 import BlockFP8Weight


@triton.jit
def _w8a8_gemm_kernel(
    x_ptr,
    xs_ptr,
    w_ptr,
    s_ptr,
    bias_ptr,
    res_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xsm,
    stride_wn,
    stride_sn,
    stride_rm,
    stride_om,
    offset,
    QBLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ALIGNED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    RESIDUAL: tl.constexpr,
    FIX: tl.constexpr,
    INTERP: tl.constexpr,
    SCALE_PERIOD: tl.constexpr = 0,
):
    pid_n = tl.program_id(0)
    m0 = tl.program_id(1) * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = offs_m[:, None] < M
    col_ok = offs_n[:, None] < N
    cols = tl.arange(0, QBLOCK) - offset
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + cols[None, :]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + cols[None, :]
    s_rows = scale_rows(s_ptr, offs_n, pid_n * BLOCK_N, stride_sn, SCALE_PERIOD)
    xs_rows = xs_ptr + offs_m.to(tl.int64) * stride_xsm
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for t in range(0, tl.cdiv(K + offset, QBLOCK)):
        if ALIGNED:  # K a multiple of the tile, from a tile boundary: no column mask
            w = tl.load(w_ptrs, mask=col_ok, other=0.0)
            x = tl.load(x_ptrs, mask=row_ok, other=0.0)
        else:
            c = t * QBLOCK + cols
            c_ok = (c >= 0) & (c < K)
            w = tl.load(w_ptrs, mask=col_ok & c_ok[None, :], other=0.0)
            x = tl.load(x_ptrs, mask=row_ok & c_ok[None, :], other=0.0)
        w_scale = tl.load(s_rows + t, mask=offs_n < N, other=0.0)
        x_scale = tl.load(xs_rows + t, mask=offs_m < M, other=0.0)
        acc += dot_fp8(w, tl.trans(x), INTERP) * w_scale[:, None] * x_scale[None, :]
        x_ptrs += QBLOCK
        w_ptrs += QBLOCK
    first = m0.to(tl.int64)
    tile_epilogue(
        acc, tl.zeros((BLOCK_M,), dtype=tl.float32), pid_n, bias_ptr, res_ptr + first * stride_rm,
        out_ptr + first * stride_om, M - m0, N, K, stride_rm, stride_om, 0.0,
        BLOCK_M, BLOCK_N, HAS_BIAS, False, SILU, RESIDUAL, FIX,
    )  # fmt: skip


def default_tiles(n: int, m: int, sms: int = 132) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)``: decode rows in one 16..64-row tile, the widest
    weight tiles (128, 64, then 32 rows) whose programs fill at least 80% of their last wave over the
    ``sms`` multiprocessors; prefill 64 x 128. Not swept on a GPU yet."""
    if m > 64:
        return 64, 128, 8, 4

    def fill(block_n: int) -> float:
        tiles = triton.cdiv(n, block_n)
        return tiles / (triton.cdiv(tiles, sms) * sms)

    block_n = next((b for b in (128, 64) if fill(b) >= 0.8), 32)
    return max(16, triton.next_power_of_2(m)), block_n, 4, 6


def block_fp8_w8a8_triton(
    x: torch.Tensor,
    w: BlockFP8Weight,
    bias: torch.Tensor | None = None,
    *,
    silu: bool = False,
    residual: torch.Tensor | None = None,
    tiles: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """``x @ w.T (+ bias)`` for ``x`` ``[..., K]`` of any row count, in ``x``'s dtype, the activations
    quantized per row and weight tile. ``silu``: ``w``'s rows alternate gate, up, returns ``silu(gate) *
    up`` ``[..., N / 2]``; ``residual``: returns ``residual + x @ w.T``, written into ``residual`` in
    place. ``tiles``: ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` instead of :func:`default_tiles`."""
    weight, scale = w.weight, w.scale
    n, k = weight.shape
    if w.block not in (32, 64, 128):
        raise ValueError(
            f"W8A8 takes quantization tiles of 32, 64 or 128 columns (the FP8 MMA's K is 32+; wider tiles "
            f"overflow the pipeline's shared memory), not {w.block}"
        )
    x2, out = gemm_operands(x, w, silu, residual)
    m = x2.shape[0]
    n_out = out.shape[1]
    check_fp8_mma(x.device)
    if m:
        block_m, block_n, warps, stages = tiles or default_tiles(n, m, num_sms(x.device))
        x2, xs = quantize_activations(x2, w.block, w.offset)
        _w8a8_gemm_kernel[(triton.cdiv(n, block_n), triton.cdiv(m, block_m))](
            x2, xs, weight, scale, bias if bias is not None else scale, out, out,
            m, n, k, x2.stride(0), xs.stride(0), weight.stride(0), scale.stride(0), out.stride(0),
            out.stride(0), w.offset,
            QBLOCK=w.block, BLOCK_M=block_m, BLOCK_N=block_n,
            ALIGNED=w.offset == 0 and k % w.block == 0, HAS_BIAS=bias is not None, SILU=silu,
            RESIDUAL=residual is not None, FIX=interp_bf16(x.dtype), INTERP=interpreting(),
            SCALE_PERIOD=w.scale_period(block_n), num_warps=warps, num_stages=stages,
        )  # fmt: skip
    return out.reshape(*x.shape[:-1], n_out)
