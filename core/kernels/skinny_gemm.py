"""Skinny GEMM: ``y = x @ w.T (+ bias)`` for a few rows of ``x`` (decode), beside its torch reference.

At batch 1..16 a projection is a weight read: every byte of ``w`` is read once and each is used for only
a few multiply-adds. On the H200 cuBLAS's small-M kernels leave 10-20% of the HBM bandwidth unused on
the 5120-wide projections (measured side by side: ``python bench/skinny_gemm.py``).
This kernel tiles ``w`` by ``BLOCK_N`` output rows and streams ``BLOCK_K`` columns at a time through a
deep load pipeline.

Three neighbours of a decoder layer's projections run inside it, each without an extra pass over memory
(at batch 1 every small kernel costs a few microseconds of dependent-launch latency, ~120 of them a
step): the RMSNorm before a projection (its statistic gathers from the x tiles the loop loads anyway and
scales the output rows, its weight folded into ``w``), SiLU·mul after gate|up (rows interleaved so each
program holds whole gate, up pairs) and the residual add after o_proj and down. Earlier forms measured
slower and are not offered: computing ``silu(gate) * up`` while loading the down projection's input
(2.5x), streaming separate gate and up tiles side by side (+0.35 ms a batch-1 step), and normalising
the row before the loop with the norm's weight applied to each x tile (+0.15 ms: three loads a step).

- :func:`skinny_linear`: the dispatching entry (Triton on CUDA for ``M <= DISPATCH_ROWS``, else F.linear).
- ``pegainfer.layers.norm.fold_rms_norm_weight`` and ``pegainfer.layers.activation.interleave_gate_up`` give
  the weights the layouts those options take.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pegainfer.kernels._triton import (
    cast_to,
    dot_precision,
    interp_bf16,
    mma,
    num_sms,
    pdl_launch,
    pdl_start,
    shared_memory_per_sm,
    tl,
    triton,
    use_kernel,
)
from pegainfer.kernels.activations import silu_mul_ref
from pegainfer.layers.block_fp8 import BlockFP8Weight
from pegainfer.layers.norm import rms_norm as rms_norm_ref
from pegainfer.layers.norm import rms_norm_gated

#: Most rows of x the kernel takes (x is padded to a 16-, 32- or 64-row tile).
MAX_ROWS = 64
#: Rows up to which ``skinny_linear`` dispatches to the kernel (cuBLAS above); a module setting so a
#: benchmark can compare both sides of it.
DISPATCH_ROWS = 16


@dataclass(frozen=True)
class SkinnyConfig:
    """Tiles of one launch. ``stream_k``: the work is split evenly over ``programs`` programs (0: one per
    multiprocessor) at column-block granularity, tiles shared between programs (``_skinny_gemm_stream_k_
    kernel``), where one program per output tile leaves multiprocessors idle."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4
    stream_k: bool = False
    programs: int = 0


@dataclass(frozen=True)
class GatedNorm:
    """A gated RMSNorm over heads of ``D`` columns applied to x before the GEMM (``gemv_preload_triton(
    gated=...)``): each head of x is RMS-normalised, scaled by ``weight`` ``[D]`` and multiplied by
    ``silu(z)``, ``z`` a row as wide as x (a view with a row stride is fine). A linear-attention layer's
    output norm run inside its output projection instead of as a launch of its own."""

    z: torch.Tensor
    weight: torch.Tensor
    eps: float


@dataclass(frozen=True)
class RowNorm:
    """An RMSNorm with a zero-centred weight applied to x before the GEMM (``gemv_preload_triton(
    row_norm=...)``): ``x * rsqrt(mean(x²) + eps) * (1 + weight)`` in fp32, cast once (Qwen3.5's layer
    norm), also written into ``out`` (one row as wide as x) for the block's other consumers. A MoE block's
    norm run inside its router's GEMV instead of as a launch of its own."""

    weight: torch.Tensor
    eps: float
    out: torch.Tensor


@triton.jit
def load_block(ptrs, k, K, offs_k, rows_ok, EVEN_K: tl.constexpr):
    """The ``k``-th column block of x or w (``ptrs`` point at it), zero outside ``rows_ok`` and ``K``."""
    if EVEN_K:
        return tl.load(ptrs, mask=rows_ok, other=0.0)
    return tl.load(ptrs, mask=rows_ok & ((k + offs_k)[None, :] < K), other=0.0)


@triton.jit
def scale_rows(s_ptr, offs_n, row0, stride_sn, PERIOD: tl.constexpr):
    """Pointers to the scales of a block-FP8 weight's rows ``offs_n`` (``row0``: the tile's first): each
    row's own (PERIOD 0), or where the tile lies inside a group of rows that share their scales
    (``BlockFP8Weight.scale_period``) the tile's first row's (PERIOD 1), or its first two rows'
    alternately (PERIOD 2: gate and up rows interleaved). One or two addresses a tile instead of a row
    each: the float8 GEMMs at one row measured 10-22% faster so (H100, ``scratch`` sweep, no record)."""
    if PERIOD == 0:
        return s_ptr + offs_n.to(tl.int64) * stride_sn
    elif PERIOD == 1:
        return s_ptr + (row0 + tl.zeros_like(offs_n)).to(tl.int64) * stride_sn
    else:
        return s_ptr + (row0 + offs_n % 2).to(tl.int64) * stride_sn


@triton.jit
def widen_float8(
    w, s_rows, k, K, col_ok, QBLOCK: tl.constexpr, SPAN: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DTYPE: tl.constexpr, FIX: tl.constexpr,
):  # fmt: skip
    """``w`` as loaded; with ``SPAN`` (a block-FP8 weight) its float8 block of columns ``[k, k + BLOCK_K)``
    widened to ``DTYPE`` times each row's scales (``s_rows``: the rows' scale pointers), the block
    spanning ``SPAN`` quantization tiles of ``QBLOCK`` columns (or lying inside one: SPAN 1)."""
    if SPAN == 0:
        return w
    else:
        tiles = k // QBLOCK + tl.arange(0, SPAN)
        scale = tl.load(
            s_rows[:, None] + tiles[None, :], mask=col_ok & (tiles * QBLOCK < K)[None, :], other=0.0
        )
        wf = tl.reshape(w.to(tl.float32), (BLOCK_N, SPAN, BLOCK_K // SPAN)) * scale[:, :, None]
        return cast_to(tl.reshape(wf, (BLOCK_N, BLOCK_K)), DTYPE, FIX)


@triton.jit
def _skinny_gemm_kernel(
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
    eps,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    NORM: tl.constexpr,
    SILU: tl.constexpr,
    RESIDUAL: tl.constexpr,
    FIX: tl.constexpr,
    PREC: tl.constexpr,
    PDL: tl.constexpr,
    QBLOCK: tl.constexpr = 1,
    SPAN: tl.constexpr = 0,
    SCALE_PERIOD: tl.constexpr = 0,
):
    pid_n = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    s_rows = scale_rows(s_ptr, offs_n, pid_n * BLOCK_N, stride_sn, SCALE_PERIOD)
    row_ok = offs_m[:, None] < M
    col_ok = offs_n[:, None] < N
    dtype: tl.constexpr = x_ptr.dtype.element_ty
    # w is the tensor cores' wide operand ([BLOCK_N, BLOCK_K] @ [BLOCK_K, BLOCK_M]): a 16-row x would
    # waste most of an MMA tile as the wide one, and the sweep measured this form 5-30% faster.
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    # With NORM, x's sum of squares (its RMSNorm statistic) gathers from the x tiles the loop loads anyway.
    sq = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    k0 = 0
    if PDL:
        # The weights are constant: fetch the first block while the previous kernel is still finishing,
        # and only then wait for it (x is its output).
        w = load_block(w_ptrs, 0, K, offs_k, col_ok, EVEN_K)
        w = widen_float8(w, s_rows, 0, K, col_ok, QBLOCK, SPAN, BLOCK_N, BLOCK_K, dtype, FIX)
        pdl_start(PDL)
        x = load_block(x_ptrs, 0, K, offs_k, row_ok, EVEN_K)
        if NORM:
            sq += x.to(tl.float32) * x.to(tl.float32)
        acc += mma(w, tl.trans(x).to(w.dtype), FIX, PREC)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        k0 = BLOCK_K
    for k in range(k0, K, BLOCK_K):
        x = load_block(x_ptrs, k, K, offs_k, row_ok, EVEN_K)
        w = load_block(w_ptrs, k, K, offs_k, col_ok, EVEN_K)
        w = widen_float8(w, s_rows, k, K, col_ok, QBLOCK, SPAN, BLOCK_N, BLOCK_K, dtype, FIX)
        if NORM:
            sq += x.to(tl.float32) * x.to(tl.float32)
        acc += mma(w, tl.trans(x).to(w.dtype), FIX, PREC)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    tile_epilogue(
        acc, tl.sum(sq, 1), pid_n, bias_ptr, res_ptr, out_ptr, M, N, K, stride_rm, stride_om, eps,
        BLOCK_M, BLOCK_N, HAS_BIAS, NORM, SILU, RESIDUAL, FIX,
    )  # fmt: skip


@triton.jit
def tile_epilogue(
    acc,
    sq,
    tile,
    bias_ptr,
    res_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_rm,
    stride_om,
    eps,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    NORM: tl.constexpr,
    SILU: tl.constexpr,
    RESIDUAL: tl.constexpr,
    FIX: tl.constexpr,
):
    """Finish output tile ``tile`` from its fp32 sum ``acc`` ``[BLOCK_N, BLOCK_M]`` and, with NORM, the
    rows' sums of squares ``sq`` ``[BLOCK_M]``: the norm's scale, bias, then SiLU·mul or the residual add."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = offs_m[:, None] < M
    acc = tl.trans(acc)
    if NORM:
        # rms_norm(x) @ w.T == rstd * (x @ w.T), w carrying the norm's weight (fold_rms_norm_weight).
        acc = acc * tl.rsqrt(sq / K + eps)[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    if SILU:
        # w's rows alternate gate, up (interleave_gate_up): each program holds whole pairs. Rounded as the
        # GEMM's output and silu_mul's steps would be.
        y = cast_to(acc, dtype, FIX).to(tl.float32)
        gate, up = tl.split(tl.reshape(y, (BLOCK_M, BLOCK_N // 2, 2)))
        act = cast_to(gate / (1.0 + tl.exp(-gate)), dtype, FIX).to(tl.float32) * up
        offs_a = tile * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        a_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_a[None, :]
        tl.store(a_ptrs, cast_to(act, dtype, FIX), mask=row_ok & (offs_a[None, :] < N // 2))
    else:
        out_ok = row_ok & (offs_n[None, :] < N)
        if RESIDUAL:
            # The residual stream's add, rounded as torch's ``residual + linear(x)`` rounds.
            r = tl.load(res_ptr + offs_m[:, None] * stride_rm + offs_n[None, :], mask=out_ok, other=0.0)
            acc = cast_to(acc, dtype, FIX).to(tl.float32) + r.to(tl.float32)
        out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, cast_to(acc, dtype, FIX), mask=out_ok)


@triton.jit
def _last_to_arrive(count_ptr, tile, parts):
    """Called by each of the ``parts`` programs that share output tile ``tile`` once its partial sums are
    stored: whether it arrived last, so that it adds them all (in slot order: the result does not depend
    on the order of arrival) and then resets the tile's counter for the next launch."""
    # Every thread's partial is stored before the counter's release (one thread's atomic).
    tl.debug_barrier()
    return tl.atomic_add(count_ptr + tile, 1, sem="acq_rel") == parts - 1


@triton.jit
def _skinny_gemm_stream_k_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    bias_ptr,
    res_ptr,
    out_ptr,
    part_ptr,
    part_sq_ptr,
    count_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_rm,
    stride_om,
    eps,
    K_ITERS,
    UNITS,
    SLOTS,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    NORM: tl.constexpr,
    SILU: tl.constexpr,
    RESIDUAL: tl.constexpr,
    FIX: tl.constexpr,
    PREC: tl.constexpr,
    PDL: tl.constexpr,
    QBLOCK: tl.constexpr = 1,
    SPAN: tl.constexpr = 0,
    SCALE_PERIOD: tl.constexpr = 0,
):
    """The same GEMM over a flat list of work units, (output tile, BLOCK_K column block) in tile order:
    program ``p`` takes units ``[p * UNITS, (p + 1) * UNITS)``, so every multiprocessor streams the same
    number of weight bytes whatever the tile count. A tile whose columns span several programs gathers
    their fp32 partial sums in its slots of ``part_ptr`` (slot = program - the tile's first program); the
    program that finishes last (the tile's counter) adds them in slot order, so the result does not
    depend on which finished first, and resets the counter for the next launch."""
    pid = tl.program_id(0)
    dtype: tl.constexpr = x_ptr.dtype.element_ty
    n_tiles = tl.cdiv(N, BLOCK_N)
    u0 = pid * UNITS
    u1 = tl.minimum(u0 + UNITS, n_tiles * K_ITERS)
    pdl_start(PDL)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    offs_t = tl.arange(0, BLOCK_N)
    row_ok = offs_m[:, None] < M
    part_offs = offs_t[:, None] * BLOCK_M + offs_m[None, :]
    for tile in range(u0 // K_ITERS, (u1 - 1) // K_ITERS + 1):
        kb = tl.maximum(u0 - tile * K_ITERS, 0)
        ke = tl.minimum(u1 - tile * K_ITERS, K_ITERS)
        offs_n = tile * BLOCK_N + offs_t
        col_ok = offs_n[:, None] < N
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (kb * BLOCK_K + offs_k)[None, :]
        w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (kb * BLOCK_K + offs_k)[None, :]
        s_rows = scale_rows(s_ptr, offs_n, tile * BLOCK_N, stride_sn, SCALE_PERIOD)
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        sq = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
        for i in range(kb, ke):
            x = load_block(x_ptrs, i * BLOCK_K, K, offs_k, row_ok, EVEN_K)
            w = load_block(w_ptrs, i * BLOCK_K, K, offs_k, col_ok, EVEN_K)
            w = widen_float8(w, s_rows, i * BLOCK_K, K, col_ok, QBLOCK, SPAN, BLOCK_N, BLOCK_K, dtype, FIX)
            if NORM:
                sq += x.to(tl.float32) * x.to(tl.float32)
            acc += mma(w, tl.trans(x).to(w.dtype), FIX, PREC)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        sq_rows = tl.sum(sq, 1)
        if kb == 0 and ke == K_ITERS:
            tile_epilogue(
                acc, sq_rows, tile, bias_ptr, res_ptr, out_ptr, M, N, K, stride_rm, stride_om, eps,
                BLOCK_M, BLOCK_N, HAS_BIAS, NORM, SILU, RESIDUAL, FIX,
            )  # fmt: skip
        else:
            first = (tile * K_ITERS) // UNITS
            parts = ((tile + 1) * K_ITERS - 1) // UNITS - first + 1
            slot = (tile * SLOTS + pid - first).to(tl.int64)
            tl.store(part_ptr + slot * (BLOCK_N * BLOCK_M) + part_offs, acc)
            if NORM:
                tl.store(part_sq_ptr + slot * BLOCK_M + offs_m, sq_rows)
            if _last_to_arrive(count_ptr, tile, parts):
                acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
                sq_rows = tl.zeros((BLOCK_M,), dtype=tl.float32)
                for s in range(parts):
                    at = (tile * SLOTS + s).to(tl.int64)
                    # .cg: from L2, where the other programs' stores are, never a stale L1 line.
                    acc += tl.load(part_ptr + at * (BLOCK_N * BLOCK_M) + part_offs, cache_modifier=".cg")
                    if NORM:
                        sq_rows += tl.load(part_sq_ptr + at * BLOCK_M + offs_m, cache_modifier=".cg")
                tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed")
                tile_epilogue(
                    acc, sq_rows, tile, bias_ptr, res_ptr, out_ptr, M, N, K, stride_rm, stride_om, eps,
                    BLOCK_M, BLOCK_N, HAS_BIAS, NORM, SILU, RESIDUAL, FIX,
                )  # fmt: skip


@triton.jit
def _gemv_preload_kernel(
    x_ptr,
    w_ptr,
    res_ptr,
    out_ptr,
    part_ptr,
    count_ptr,
    N,
    stride_wn,
    eps,
    z_ptr,
    gw_ptr,
    nout_ptr,
    BLOCK_N: tl.constexpr,
    K_SPAN: tl.constexpr,
    SPLITS: tl.constexpr,
    RESIDUAL: tl.constexpr,
    FIX: tl.constexpr,
    PDL: tl.constexpr,
    GATED_D: tl.constexpr = 0,
    ROW_NORM: tl.constexpr = False,
):
    """One row of x: program (tile, split) loads its whole ``[BLOCK_N, K_SPAN]`` slice of w into registers
    before its PDL wait, so the weights stream in while the kernels before it still run, and after the
    wait reads only x's ``K_SPAN`` columns. A tile's split partials are summed in split order by the
    last of its programs to arrive (as in the stream-K kernel), which then writes the output. With
    ``GATED_D`` x is first put through :func:`_gated_norm_row`; with ``ROW_NORM`` (one split: each program
    holds the whole row) through :func:`_zero_centred_row`, which tile 0 also stores."""
    tile = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = split * K_SPAN + tl.arange(0, K_SPAN)
    n_ok = offs_n < N
    w = tl.load(
        w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :], mask=n_ok[:, None], other=0.0
    )
    pdl_start(PDL)
    x = tl.load(x_ptr + offs_k)
    if GATED_D > 0:
        x = _gated_norm_row(x, z_ptr, gw_ptr, offs_k, eps, K_SPAN, GATED_D, FIX)
    if ROW_NORM:
        x = _zero_centred_row(x, gw_ptr, nout_ptr, offs_k, eps, tile == 0, K_SPAN, FIX)
    x = x.to(tl.float32)
    acc = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    if SPLITS > 1:
        offs_t = tl.arange(0, BLOCK_N)
        tl.store(part_ptr + (tile * SPLITS + split) * BLOCK_N + offs_t, acc)
        if _last_to_arrive(count_ptr, tile, SPLITS):
            acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for s in range(SPLITS):
                # .cg: from L2, where the other programs' stores are, never a stale L1 line.
                acc += tl.load(part_ptr + (tile * SPLITS + s) * BLOCK_N + offs_t, cache_modifier=".cg")
            tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed")
            _gemv_epilogue(acc, offs_n, n_ok, res_ptr, out_ptr, RESIDUAL, FIX)
    else:
        _gemv_epilogue(acc, offs_n, n_ok, res_ptr, out_ptr, RESIDUAL, FIX)


@triton.jit
def _gated_norm_row(o, z_ptr, gw_ptr, offs_k, eps, K_SPAN: tl.constexpr, D: tl.constexpr, FIX: tl.constexpr):
    """The gated RMSNorm of the heads of ``D`` columns in one row's ``K_SPAN`` columns ``o`` (at
    ``offs_k``): ``((w * norm(o)) * silu(z))``, rounded at each step as a separate norm kernel rounds it
    (``layers.norm.rms_norm_gated``), so the GEMV reads the very values that kernel would have written."""
    dtype: tl.constexpr = o.dtype
    o = tl.reshape(o.to(tl.float32), (K_SPAN // D, D))
    n = cast_to(o * tl.rsqrt(tl.sum(o * o, 1) / D + eps)[:, None], dtype, FIX).to(tl.float32)
    y = cast_to(tl.load(gw_ptr + tl.arange(0, D)).to(tl.float32)[None, :] * n, dtype, FIX).to(tl.float32)
    z = tl.reshape(tl.load(z_ptr + offs_k).to(tl.float32), (K_SPAN // D, D))
    return tl.reshape(cast_to(y * (z / (1.0 + tl.exp(-z))), dtype, FIX), (K_SPAN,))


@triton.jit
def _zero_centred_row(x, w_ptr, out_ptr, offs_k, eps, store, K_SPAN: tl.constexpr, FIX: tl.constexpr):
    """``x * rsqrt(mean(x²) + eps) * (1 + w)`` of the whole row ``x`` (``K_SPAN`` columns) in fp32, cast
    once, as the zero-centred norm kernel computes it; stored into ``out_ptr`` where ``store``."""
    dtype: tl.constexpr = x.dtype
    x = x.to(tl.float32)
    w = tl.load(w_ptr + offs_k).to(tl.float32)
    y = cast_to(x * tl.rsqrt(tl.sum(x * x, 0) / K_SPAN + eps) * (1.0 + w), dtype, FIX)
    if store:
        tl.store(out_ptr + offs_k, y)
    return y


@triton.jit
def _gemv_epilogue(acc, offs_n, n_ok, res_ptr, out_ptr, RESIDUAL: tl.constexpr, FIX: tl.constexpr):
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    if RESIDUAL:
        # Rounded as torch's ``residual + linear(x)`` rounds.
        r = tl.load(res_ptr + offs_n, mask=n_ok, other=0.0)
        acc = cast_to(acc, dtype, FIX).to(tl.float32) + r.to(tl.float32)
    tl.store(out_ptr + offs_n, cast_to(acc, dtype, FIX), mask=n_ok)


#: Single rows whose weight fits :func:`preload_fits` take :func:`gemv_preload_triton` where PDL is on,
#: unless ``PEGAINFER_GEMV_PRELOAD=0`` (the benchmarks compare). Qwen3.5-35B-A3B's batch-1 step (its
#: out_proj, o_proj and router) 2.67 -> 2.56 ms on an H200 (docs/benchmarks.md, twenty-seventh session).
GEMV_PRELOAD = os.environ.get("PEGAINFER_GEMV_PRELOAD", "1") != "0"

#: ``gemv_preload``'s slice of w a program holds: 16 rows x 2048 columns, 64 KiB in bf16 over 8 warps (64
#: registers a thread), two programs a multiprocessor.
PRELOAD_BLOCK_N, PRELOAD_K_SPAN, PRELOAD_WARPS = 16, 2048, 8


def takes_preload(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether a plain ``x @ w.T`` goes through :func:`gemv_preload_triton` (with ``GEMV_PRELOAD``)."""
    return (
        GEMV_PRELOAD
        and x.numel() == x.shape[-1]
        and x.dtype == w.dtype
        and pdl_launch(x)["PDL"]
        and preload_fits(*w.shape, w.element_size(), num_sms(x.device))
    )


def preload_fits(n: int, k: int, element_size: int, sms: int) -> bool:
    """Whether every program of :func:`gemv_preload_triton` for a ``[n, k]`` w can be resident at once
    (two a multiprocessor), which is what lets the whole weight stream in before the wait."""
    if k % PRELOAD_K_SPAN or element_size != 2:
        return False
    return triton.cdiv(n, PRELOAD_BLOCK_N) * (k // PRELOAD_K_SPAN) <= 2 * sms


def gemv_preload_triton(
    x: torch.Tensor,
    w: torch.Tensor,
    *,
    residual: torch.Tensor | None = None,
    gated: GatedNorm | None = None,
    row_norm: RowNorm | None = None,
) -> torch.Tensor:
    """``x @ w.T`` (``+ residual``, in place) for one 16-bit row ``x`` ``[1, K]`` whose ``w`` fits
    :func:`preload_fits`: each program holds its slice of w before it waits for the previous kernel.
    ``gated``: the GEMM of the :class:`GatedNorm` of ``x`` (its heads dividing a slice). ``row_norm``: the
    GEMM of the :class:`RowNorm` of ``x`` (``K`` one slice wide), the normed row written as well."""
    n, k = w.shape
    if row_norm is not None:
        o = row_norm.out
        if gated is not None or k != PRELOAD_K_SPAN or row_norm.weight.numel() != k:
            raise ValueError(
                f"gemv_preload: a row norm takes a row of {PRELOAD_K_SPAN} columns, no gated norm"
            )
        if o.numel() != k or o.dtype != x.dtype or not o.is_contiguous():
            raise ValueError(f"gemv_preload: the row norm's out must be one contiguous {x.dtype} row of {k}")
    if gated is not None:
        d = gated.weight.numel()
        z = gated.z
        if PRELOAD_K_SPAN % d or d & (d - 1) or z.numel() != k or z.stride(-1) != 1:
            raise ValueError(
                f"gemv_preload: a gated norm of power-of-two heads dividing {PRELOAD_K_SPAN} columns,"
                f" z one contiguous row of {k} (got heads of {d}, z {tuple(z.shape)})"
            )
    if (
        x.numel() != k
        or x.dtype != w.dtype
        or w.element_size() != 2
        or w.stride(-1) != 1
        or k % PRELOAD_K_SPAN
    ):
        raise ValueError(
            f"gemv_preload takes one {w.dtype} row for a [n, k] w with k a multiple of {PRELOAD_K_SPAN}"
        )
    x1 = x.reshape(k).contiguous()
    eps = gated.eps if gated is not None else row_norm.eps if row_norm is not None else 0.0
    norm_w = gated.weight if gated is not None else row_norm.weight if row_norm is not None else x1
    out = torch.empty(n, dtype=w.dtype, device=x.device) if residual is None else residual.view(n)
    tiles, splits = triton.cdiv(n, PRELOAD_BLOCK_N), k // PRELOAD_K_SPAN
    part, _, count = _stream_k_workspace(x.device, tiles, splits, PRELOAD_BLOCK_N, 1)
    _gemv_preload_kernel[(tiles, splits)](
        x1, w, out, out, part, count, n, w.stride(0), eps,
        gated.z if gated else x1, norm_w, row_norm.out if row_norm else x1,
        BLOCK_N=PRELOAD_BLOCK_N, K_SPAN=PRELOAD_K_SPAN, SPLITS=splits, RESIDUAL=residual is not None,
        FIX=interp_bf16(w.dtype), GATED_D=gated.weight.numel() if gated else 0, ROW_NORM=row_norm is not None,
        num_warps=PRELOAD_WARPS, num_stages=1, **pdl_launch(x),
    )  # fmt: skip
    return out.reshape(*x.shape[:-1], n)


def default_config(n: int, k: int, m: int = 1, element_size: int = 2, sms: int = 132) -> SkinnyConfig:
    """Tiles measured on the H200 (``python bench/skinny_gemm.py --sweep``, 2026-12-02 and earlier): 64
    rows of w per program, 256 columns per load, four loads in flight; 64 columns and three loads for
    gate|up-sized projections (20k+ rows), 128 columns for lm_head-sized ones (100k+).

    One program per 64-row tile leaves multiprocessors idle where the tiles fill under 80% of the last
    wave over the ``sms`` multiprocessors (the 4096/5120-row projections make 64/80 programs for 132):
    those long enough to split (K >= 4096) take the stream-K split, measured at Qwen3-14B's down 57.6 ->
    45.0 us, o_proj 18.4 -> 16.5, DeepSeek-V3's kv_a 13.8 -> 6.3; with 32-row tiles and five loads where
    w is at most 4096 x 8192 (kv_a 6.0, Qwen3.5-9B's out_proj 10.6 -> 10.3). It lost at ~85% filled waves
    (Qwen3-14B q|k|v 19.2 -> 21.2) and on short K (DeepSeek's shared down, K 2048). Very long rows in
    nearly full waves (DeepSeek's o_proj and dense down, K >= 16384) measured best with 32-row tiles.
    Short rows (K <= 2048) past one wave of tiles take 128 columns a load, so several programs share a
    multiprocessor (``--model qwen35_35b_a3b --rows 1 --sweep``, 2026-12-04): the 35B-A3B shape's GDN
    in_proj 16.1 -> 14.4 us, its attention q|gate|k|v 14.7 -> 11.6 (cuBLAS 11.7)."""
    tiles = triton.cdiv(n, 64)
    underfilled = k >= 4096 and tiles < 0.8 * triton.cdiv(tiles, sms) * sms
    # Wider x tiles (or fp32) need shorter loads to keep the stages in shared memory.
    if m <= 16 and element_size > 2 and underfilled:
        return SkinnyConfig(32, 128, stream_k=True)  # an fp32 router's few rows (no sweep yet)
    if m > 16 or element_size > 2 or n >= 100_000:
        return SkinnyConfig(64, 128)
    if n >= 20_000:
        return SkinnyConfig(64, 64, num_stages=3)
    if k <= 2048 and tiles > sms:
        return SkinnyConfig(64, 128)
    if underfilled:
        if n <= 4096 and k <= 8192:
            return SkinnyConfig(32, 256, num_stages=5, stream_k=True)
        return SkinnyConfig(64, 256, stream_k=True)
    if k >= 16384:
        return SkinnyConfig(32, 256)
    return SkinnyConfig(64, 256)


_WORKSPACES: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _stream_k_workspace(
    device: torch.device, n_tiles: int, slots: int, block_n: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The split tiles' fp32 partial sums, their rows' partial sums of squares and the tiles' arrival
    counters (zero between launches: the last program of a tile resets its counter), one set per launch
    shape and kept, so a CUDA graph captures fixed addresses. Launches on one stream may share a set: a
    launch touches it only after the previous kernel finished (``pdl_start``)."""
    key = (device, n_tiles, slots, block_n, block_m)
    if key not in _WORKSPACES:
        _WORKSPACES[key] = (
            torch.empty(n_tiles * slots * block_n * block_m, dtype=torch.float32, device=device),
            torch.empty(n_tiles * slots * block_m, dtype=torch.float32, device=device),
            torch.zeros(n_tiles, dtype=torch.int32, device=device),
        )
    return _WORKSPACES[key]


#: Launch arguments without programmatic dependent launch.
NO_PDL = {"PDL": False, "launch_pdl": False}


def _one_program_per_sm(cfg: SkinnyConfig, block_m: int, x: torch.Tensor) -> bool:
    """Whether the pipeline's tiles take over half a multiprocessor's shared memory, so no two programs
    share one. Only such a GEMM is launched early (PDL): its waiting programs can then only take idle
    multiprocessors, one each. Programs that fit several to a multiprocessor piled onto the few that the
    previous GEMM left idle and made the step slower (batch 1: 7.98 ms with PDL for every GEMM, 7.45
    without it for any, 7.38 with this rule; one H200, one call)."""
    smem = cfg.num_stages * (cfg.block_n + block_m) * cfg.block_k * x.element_size()
    return 2 * smem > shared_memory_per_sm(x.device)


def skinny_linear_triton(
    x: torch.Tensor,
    w: torch.Tensor | BlockFP8Weight,
    bias: torch.Tensor | None = None,
    *,
    config: SkinnyConfig | None = None,
    norm_eps: float | None = None,
    silu: bool = False,
    residual: torch.Tensor | None = None,
    gated: GatedNorm | None = None,
) -> torch.Tensor:
    """The Triton path of :func:`skinny_linear` for ``x`` ``[..., K]`` with at most ``MAX_ROWS`` rows.
    Each option moves a neighbouring op of a decoder layer into the GEMM, where it costs no extra pass:

    - ``norm_eps``: ``x`` is taken un-normed and RMSNorm'ed first; ``w`` must carry the norm's weight
      (``layers.norm.fold_rms_norm_weight``), as the kernel scales each output row by x's ``1 / rms``;
    - ``silu``: ``w``'s rows alternate gate, up (``layers.activation.interleave_gate_up``); returns
      ``silu(gate) * up``, ``[..., N / 2]``;
    - ``residual``: returns ``residual + x @ w.T``, written into ``residual`` in place;
    - ``gated``: the GEMM of x's :class:`GatedNorm` (where :func:`takes_preload`, ``residual`` allowed).

    A 16-bit ``x`` may meet an fp32 ``w`` (a router's logits): x is upcast in the loop, the result fp32,
    as ``F.linear(x.float(), w)`` without the cast's launch. A block-FP8 ``w`` whose columns start on a
    tile boundary is widened tile by tile with its rows' scales (W8A16), the result in ``x``'s dtype."""
    n, k = w.shape
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    quant = isinstance(w, BlockFP8Weight)
    if quant and w.offset:
        raise ValueError("skinny_linear takes block-FP8 columns from a tile boundary (block_fp8_gemm: any)")
    weight, scale = (w.weight, w.scale) if quant else (w, w)
    if weight.stride(-1) != 1 or scale.stride(-1) != 1:
        raise ValueError("skinny_linear needs w with a contiguous last dimension")
    if x2.shape[1] != k:
        raise ValueError(f"x has {x2.shape[1]} columns; w {tuple(w.shape)} needs {k}")
    m = x2.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"skinny_linear takes at most {MAX_ROWS} rows, got {m}")
    if silu and (residual is not None or n % 2):
        raise ValueError("silu takes an even number of interleaved gate, up rows and no residual")
    if not quant and x.dtype != w.dtype and not (w.dtype == torch.float32 and x.element_size() == 2):
        raise ValueError(f"x {x.dtype} with w {w.dtype}: only 16-bit x meets an fp32 w (upcast in the loop)")
    out_dtype = x.dtype if quant else w.dtype
    cfg = config or default_config(n, k, m, out_dtype.itemsize, num_sms(x.device))
    span = 0
    if quant:  # a load spans whole quantization tiles or lies inside one
        if cfg.block_k % w.block and w.block % cfg.block_k:
            raise ValueError(f"{cfg.block_k}-column loads neither span nor divide {w.block}-column tiles")
        span = max(1, cfg.block_k // w.block)
    block_m = max(16, triton.next_power_of_2(m))
    n_out = n // 2 if silu else n
    if residual is None:
        out = torch.empty(m, n_out, dtype=out_dtype, device=x.device)
    else:
        if residual.shape != (*x.shape[:-1], n) or residual.dtype != out_dtype or residual.stride(-1) != 1:
            raise ValueError(
                f"residual {tuple(residual.shape)} {residual.dtype} must be x @ w.T's, contiguous"
            )
        out = residual.view(m, n)
    plain = not (quant or silu or config or bias is not None or norm_eps is not None)
    if gated is not None:
        if not (plain and takes_preload(x2, w)):
            raise ValueError("a gated norm runs only inside gemv_preload: one row, a w that takes_preload")
        return gemv_preload_triton(x2, w, residual=residual, gated=gated).reshape(*x.shape[:-1], n)
    if plain and takes_preload(x2, w):
        return gemv_preload_triton(x2, w, residual=residual).reshape(*x.shape[:-1], n)
    if not m:
        return out.reshape(*x.shape[:-1], n_out)
    args = (x2, weight, scale, bias if bias is not None else weight, out, out)
    strides = (m, n, k, x2.stride(0), weight.stride(0), scale.stride(0), out.stride(0), out.stride(0))
    eps = 0.0 if norm_eps is None else norm_eps
    flags = dict(
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        HAS_BIAS=bias is not None, EVEN_K=k % cfg.block_k == 0, NORM=norm_eps is not None, SILU=silu,
        RESIDUAL=residual is not None, FIX=interp_bf16(out_dtype), PREC=dot_precision(out_dtype),
        QBLOCK=w.block if quant else 1, SPAN=span, SCALE_PERIOD=w.scale_period(cfg.block_n) if quant else 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **(pdl_launch(x) if _one_program_per_sm(cfg, block_m, x) else NO_PDL),
    )  # fmt: skip
    if cfg.stream_k:
        n_tiles, k_iters = triton.cdiv(n, cfg.block_n), triton.cdiv(k, cfg.block_k)
        units = triton.cdiv(n_tiles * k_iters, cfg.programs or num_sms(x.device))
        slots = (k_iters - 1) // units + 2  # the most programs one tile's columns can span
        ws = _stream_k_workspace(x.device, n_tiles, slots, cfg.block_n, block_m)
        _skinny_gemm_stream_k_kernel[(triton.cdiv(n_tiles * k_iters, units),)](
            *args, *ws, *strides, eps, k_iters, units, slots, **flags
        )
    else:
        _skinny_gemm_kernel[(triton.cdiv(n, cfg.block_n),)](*args, *strides, eps, **flags)
    return out.reshape(*x.shape[:-1], n_out)


def skinny_linear_ref(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm_eps: float | None = None,
    silu: bool = False,
    residual: torch.Tensor | None = None,
    gated: GatedNorm | None = None,
) -> torch.Tensor:
    """The torch reference of :func:`skinny_linear_triton`, options included."""
    x = x.to(w.dtype)
    if gated is not None:
        x = rms_norm_gated(x, gated.z, gated.weight, gated.eps)
    if norm_eps is not None:
        x = rms_norm_ref(x, None, norm_eps)
    y = F.linear(x, w, bias)
    if silu:
        return silu_mul_ref(y)
    return y if residual is None else residual.copy_(residual + y)


def takes_kernel(x: torch.Tensor) -> bool:
    """Whether :func:`skinny_linear` runs the kernel for ``x``: at most ``DISPATCH_ROWS`` 16-bit rows on
    CUDA (cuBLAS wins above). (``w`` may be fp32: see :func:`skinny_linear_triton`.)"""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return use_kernel(x) and rows <= DISPATCH_ROWS and x.dtype in (torch.bfloat16, torch.float16)


def skinny_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x.to(w.dtype), w, bias)``: the kernel where :func:`takes_kernel`, the torch reference otherwise.
    (``ops.norm_linear`` and ``ops.residual_linear`` call :func:`skinny_linear_triton` with its options:
    the RMSNorm before a projection, SiLU·mul after gate|up and the residual add inside the GEMM.)"""
    if takes_kernel(x) and w.dtype in (x.dtype, torch.float32):
        return skinny_linear_triton(x, w, bias)
    return skinny_linear_ref(x, w, bias)
