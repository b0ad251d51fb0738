"""Block-FP8 GEMM (W8A16): ``y = x @ w.T`` for a float8 weight with per-row tile scales
(``pegainfer.layers.block_fp8.BlockFP8Weight``), beside its torch reference ``block_fp8_linear_ref``.

A decode step of an FP8 checkpoint is a read of its float8 bytes, half a bf16 weight's; dequantizing
the weight once at load doubles them. The kernel streams the float8 tiles, widens them to the
activations' dtype (exact: every e4m3 value is a bf16 value) and multiplies on the tensor cores; where
a kernel tile's columns sit inside one quantization tile (``BLOCK_K`` dividing the quantization block,
the columns starting on a tile boundary) each row's fp32 partial sum is scaled once per tile; where it
spans whole tiles (``BLOCK_K`` a multiple of the block) each row's few scales broadcast over their tiles
in registers; otherwise (shards that start inside a tile) each element's scale is gathered. The activations stay 16-bit:
decode is bound by the weight read, not by the multiply.

As in the skinny GEMM, ``w`` is the wide operand (``[BLOCK_N, BLOCK_K] @ [BLOCK_K, BLOCK_M]``), and the
epilogue is the skinny GEMM's: bias, SiLU·mul of interleaved gate|up rows, the residual add in place.
Rows of ``x`` beyond one ``BLOCK_M`` tile take more programs along the grid's second axis (prefill).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pegainfer.kernels import skinny_gemm
from pegainfer.kernels._triton import cast_to, dot_precision, interp_bf16, mma, num_sms, tl, triton
from pegainfer.kernels.activations import silu_mul
from pegainfer.kernels.skinny_gemm import load_block, scale_rows, tile_epilogue, widen_float8
from pegainfer.layers.block_fp8 import BlockFP8Weight

#: Rows of x up to which one program's tile covers them all (decode); above, 64-row tiles.
DECODE_ROWS = 64
#: Rows from which the weight is widened into a scratch weight in the activations' dtype and multiplied by
#: cuBLAS. At 2048 rows this kernel measured a third of cuBLAS's bf16 rate (220-264 TFLOP/s, 2026-12-05),
#: where widening costs one pass over the weight (~0.2 ms for DeepSeek-V3's dense gate|up): the
#: cross-over estimated from those figures is ~140 rows (not swept).
WIDEN_ROWS = 128

_WIDENED: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


@dataclass(frozen=True)
class Fp8GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4


@triton.jit
def _block_fp8_gemm_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    bias_ptr,
    res_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_rm,
    stride_om,
    offset,
    QBLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UNIFORM: tl.constexpr,
    SPAN: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    RESIDUAL: tl.constexpr,
    FIX: tl.constexpr,
    PREC: tl.constexpr,
    SCALE_PERIOD: tl.constexpr = 0,
):
    pid_n = tl.program_id(0)
    m0 = tl.program_id(1) * BLOCK_M
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    row_ok = (m0 + offs_m)[:, None] < M
    col_ok = offs_n[:, None] < N
    x_ptrs = x_ptr + (m0 + offs_m)[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    s_rows = scale_rows(s_ptr, offs_n, pid_n * BLOCK_N, stride_sn, SCALE_PERIOD)
    dtype: tl.constexpr = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        x = load_block(x_ptrs, k, K, offs_k, row_ok, EVEN_K)
        w = load_block(w_ptrs, k, K, offs_k, col_ok, EVEN_K)
        if UNIFORM:
            # The tile's columns share one quantization tile: the row's one scale on the fp32 partial sum.
            scale = tl.load(s_rows + (k + offset) // QBLOCK, mask=offs_n < N, other=0.0)
            acc += mma(cast_to(w.to(tl.float32), dtype, FIX), tl.trans(x), FIX, PREC) * scale[:, None]
        elif SPAN > 1:  # whole quantization tiles side by side, from a tile boundary
            w = widen_float8(w, s_rows, k, K, col_ok, QBLOCK, SPAN, BLOCK_N, BLOCK_K, dtype, FIX)
            acc += mma(w, tl.trans(x), FIX, PREC)
        else:
            tiles = (k + offs_k + offset) // QBLOCK
            scale = tl.load(
                s_rows[:, None] + tiles[None, :], mask=col_ok & ((k + offs_k)[None, :] < K), other=0.0
            )
            acc += mma(cast_to(w.to(tl.float32) * scale, dtype, FIX), tl.trans(x), FIX, PREC)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    # The epilogue's rows count from this program's first row.
    first = m0.to(tl.int64)
    tile_epilogue(
        acc, tl.zeros((BLOCK_M,), dtype=tl.float32), pid_n, bias_ptr, res_ptr + first * stride_rm,
        out_ptr + first * stride_om, M - m0, N, K, stride_rm, stride_om, 0.0,
        BLOCK_M, BLOCK_N, HAS_BIAS, False, SILU, RESIDUAL, FIX,
    )  # fmt: skip


@triton.jit
def _dequantize_kernel(
    w_ptr, s_ptr, out_ptr, N, K, stride_wn, stride_sn, stride_on, offset,
    QBLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FIX: tl.constexpr,
):  # fmt: skip
    offs_n = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
    w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :], mask=mask, other=0.0)
    tiles = ((offs_k + offset) // QBLOCK)[None, :]
    scale = tl.load(s_ptr + offs_n[:, None] * stride_sn + tiles, mask=mask, other=0.0)
    y = cast_to(w.to(tl.float32) * scale, out_ptr.dtype.element_ty, FIX)
    tl.store(out_ptr + offs_n[:, None] * stride_on + offs_k[None, :], y, mask=mask)


def dequantize_into(w: BlockFP8Weight, out: torch.Tensor) -> torch.Tensor:
    """``w.dequantize(out.dtype)`` written into ``out`` ``[N, K]`` (rounded as it rounds)."""
    n, k = w.shape
    if tuple(out.shape) != (n, k) or out.stride(-1) != 1:
        raise ValueError(f"out {tuple(out.shape)} must be the weight's {(n, k)}, rows contiguous")
    _dequantize_kernel[(triton.cdiv(n, 32), triton.cdiv(k, 256))](
        w.weight, w.scale, out, n, k, w.weight.stride(0), w.scale.stride(0), out.stride(0), w.offset,
        QBLOCK=w.block, BLOCK_N=32, BLOCK_K=256, FIX=interp_bf16(out.dtype),
    )  # fmt: skip
    return out


def widened_scratch(w: BlockFP8Weight, dtype: torch.dtype) -> torch.Tensor:
    """A ``[N, K]`` scratch weight in ``dtype`` on ``w``'s device: one buffer per device and dtype, grown to
    the largest projection widened (the memory plan reserves that: ``layers.block_fp8.widened_bytes``)."""
    key, numel = (w.weight.device, dtype), w.weight.numel()
    buffer = _WIDENED.get(key)
    if buffer is None or buffer.numel() < numel:
        _WIDENED.pop(key, None)  # the smaller one freed before the larger is allocated
        buffer = _WIDENED[key] = torch.empty(numel, dtype=dtype, device=w.weight.device)
    return buffer[:numel].view(w.shape)


def _widened_linear(
    x: torch.Tensor, w: BlockFP8Weight, bias: torch.Tensor | None, silu: bool, residual: torch.Tensor | None
) -> torch.Tensor:
    """Prefill rows: cuBLAS over the weight widened into the scratch, the options after it."""
    y = F.linear(x, dequantize_into(w, widened_scratch(w, x.dtype)), bias)
    if silu:
        return silu_mul(y)
    return y if residual is None else residual.add_(y)


def gemm_operands(
    x: torch.Tensor, w: BlockFP8Weight, silu: bool, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x2, out)`` of a block-FP8 GEMM (this module's or ``block_fp8_w8a8``'s): ``x`` as ``[M, K]`` rows
    with contiguous columns, and the ``[M, N]`` output (``[M, N / 2]`` with ``silu``; ``residual``'s
    storage where given), after checking that the operands fit together."""
    n, k = w.shape
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if x2.shape[1] != k:
        raise ValueError(f"x has {x2.shape[1]} columns; the weight {tuple(w.shape)} needs {k}")
    if w.weight.stride(-1) != 1 or w.scale.stride(-1) != 1:
        raise ValueError("a block-FP8 GEMM needs a weight and scales with contiguous rows")
    if silu and (residual is not None or n % 2):
        raise ValueError("silu takes an even number of interleaved gate, up rows and no residual")
    m = x2.shape[0]
    if residual is None:
        return x2, torch.empty(m, n // 2 if silu else n, dtype=x.dtype, device=x.device)
    if residual.shape != (*x.shape[:-1], n) or residual.dtype != x.dtype or not residual.is_contiguous():
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must be x @ w.T's, contiguous")
    return x2, residual.view(m, n)


def default_config(n: int, m: int, block: int, sms: int = 132, element_size: int = 2) -> Fp8GemmConfig:
    """Tiles not yet swept on a GPU (``python bench/skinny_gemm.py --fp8`` measures them): decode rows in
    one 16..64-row tile, the weight in 128-column loads (one quantization tile of DeepSeek's) and the
    widest row tiles (64, 32, 16) that still give every multiprocessor a program; prefill in 64 × 128
    tiles."""
    block_k = 128
    while block_k > 16 and block % block_k:
        block_k //= 2
    if m > DECODE_ROWS:  # fp32 activations (CPU-sized tests on a GPU) take fewer stages to fit
        return Fp8GemmConfig(64, 128, block_k, num_warps=8, num_stages=3 if element_size <= 2 else 2)
    block_n = next((b for b in (64, 32) if triton.cdiv(n, b) >= sms), 16)
    return Fp8GemmConfig(max(16, triton.next_power_of_2(m)), block_n, block_k)


def block_fp8_linear_triton(
    x: torch.Tensor,
    w: BlockFP8Weight,
    bias: torch.Tensor | None = None,
    *,
    silu: bool = False,
    residual: torch.Tensor | None = None,
    config: Fp8GemmConfig | None = None,
) -> torch.Tensor:
    """``x @ w.T (+ bias)`` for ``x`` ``[..., K]`` of any row count, in ``x``'s dtype. ``silu``: ``w``'s rows
    alternate gate, up (``layers.activation.interleave_gate_up``), returns ``silu(gate) * up``
    ``[..., N / 2]``; ``residual``: returns ``residual + x @ w.T``, written into ``residual`` in place.

    Unless ``config`` names this kernel's tiles: ``WIDEN_ROWS`` and more take cuBLAS over the weight
    widened into a scratch; decode rows (up to ``skinny_gemm.DISPATCH_ROWS``) of a weight whose columns
    start on a tile boundary take the tiles that measured best at one row on the H200 (``bench/
    block_fp8_gemm.py --sweep``, 2026-12-05, DeepSeek-V3's projections): for 20k+ rows (dense gate|up,
    q_b) this kernel with 32-row tiles and six loads in flight (dense gate|up 128.7 -> 87.4 us, q_b
    19.9 -> 15.3), otherwise the skinny GEMM's float8 form in 64 x 256 tiles, stream-K from K 4096
    (o_proj 58.1 -> 49.1, q_a|kv_a 11.5 -> 11.0, shared gate|up 17.9 -> 17.1, dense down 65.0 -> 61.8,
    shared down 8.6 as before)."""
    rows = x.numel() // max(x.shape[-1], 1)
    if config is None and rows >= WIDEN_ROWS:
        return _widened_linear(x, w, bias, silu, residual)
    if config is None and w.offset == 0 and rows <= skinny_gemm.DISPATCH_ROWS:
        n, k = w.shape
        spans = 256 % w.block == 0 and (256 // w.block) & (256 // w.block - 1) == 0
        if n < 20_000 and (spans or w.block % 256 == 0):
            skinny = skinny_gemm.SkinnyConfig(64, 256, stream_k=k >= 4096)
            return skinny_gemm.skinny_linear_triton(x, w, bias, silu=silu, residual=residual, config=skinny)
        config = Fp8GemmConfig(
            max(16, triton.next_power_of_2(rows)), 32, 128, num_stages=6 if k >= 4096 else 4
        )
    weight, scale = w.weight, w.scale
    n, k = weight.shape
    x2, out = gemm_operands(x, w, silu, residual)
    m = x2.shape[0]
    n_out = out.shape[1]
    if m:
        cfg = config or default_config(n, m, w.block, num_sms(x.device), x.element_size())
        uniform = w.block % cfg.block_k == 0 and w.offset % cfg.block_k == 0
        span = cfg.block_k // w.block if cfg.block_k % w.block == 0 and not w.offset else 1
        _block_fp8_gemm_kernel[(triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m))](
            x2, weight, scale, bias if bias is not None else x2, out, out,
            m, n, k, x2.stride(0), weight.stride(0), scale.stride(0), out.stride(0), out.stride(0), w.offset,
            QBLOCK=w.block, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, UNIFORM=uniform, SPAN=span if span & (span - 1) == 0 else 1,
            EVEN_K=k % cfg.block_k == 0, HAS_BIAS=bias is not None, SILU=silu, RESIDUAL=residual is not None,
            FIX=interp_bf16(x.dtype), PREC=dot_precision(x.dtype), SCALE_PERIOD=w.scale_period(cfg.block_n),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
    return out.reshape(*x.shape[:-1], n_out)
