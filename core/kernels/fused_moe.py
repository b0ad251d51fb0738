"""Routed experts in two Triton grouped GEMMs, with no host sync: ``Σ_k w[t, k] · Expert_{ids[t, k]}(x[t])``.

The (token, choice) pairs are sorted by expert on the device and each expert's run is padded to whole
blocks of ``BLOCK_M`` rows (:func:`expert_blocks`); the grid covers the most blocks any routing can need
(``P + min(P, E)·(BLOCK_M - 1)`` rows for ``P`` pairs over ``E`` experts: at batch 1 one block per
chosen expert, not one per expert), and a block past the routing's own
exits at once, so nothing depends on the host knowing the counts (graph-safe). One program owns one
block and one tile of output features: it gathers its rows' inputs and multiplies them by its expert's
weight tile, so an expert's weights are read once per block of its tokens. ``ops.fused_moe`` sends a
decode step's few tokens to ``pegainfer.kernels.moe_pairs`` instead (no sort; measured faster there), so
the batch-1 figures below describe this path when it ran those steps (until 2026-12-04).

- ``gate_up``: ``act[p] = silu(x[t] · Wg_eᵀ) ⊙ (x[t] · Wu_eᵀ)`` for pair ``p`` of token ``t`` (stacked
  gate|up ``[E, 2I, H]``), both halves in one program.
- ``down``: ``y[p] = w[p] · (act[p] · Wd_eᵀ)`` (``[E, H, I]``), then the ``k`` pairs of each token are
  summed in a fixed order (deterministic, unlike atomics) by one more launch, which also adds ``add`` (the
  shared experts' output) where given.

Block-FP8 experts (with ``BlockScales``) stay float8 in memory (W8A16), so a step reads half the bytes of
bf16 experts. Where every kernel tile sits inside one quantization tile (the usual case: 64-wide kernel
tiles in 128 × 128 blocks, shards starting on a 64 boundary) the float8 values enter the dot as they are
(exact in bf16) and the dot's fp32 result is scaled by the tile's one scale; otherwise each element is
scaled as it is loaded. With FP8 activations (``BlockScales.fp8_activations``, W8A8) x and the activation
are quantized first (``kernels.act_quant``, one pass each) and, in tiles inside one quantization tile,
meet the float8 weights on the tensor cores, each row's dot scaled by its group's scale. fp32
accumulation; the torch reference is ``pegainfer.layers.moe.routed_experts``.
"""

from __future__ import annotations

import torch

from pegainfer.kernels._triton import (
    cast_to,
    dot_precision,
    interp_bf16,
    interpreting,
    mma,
    next_pow2,
    pdl_launch,
    pdl_start,
    shared_memory_per_sm,
    tl,
    triton,
    use_kernel,
)
from pegainfer.kernels.act_quant import check_fp8_mma, dot_fp8, quantize_activations
from pegainfer.layers.moe import BlockScales, combine_routed

#: Most (token, choice) pairs the one-program sort takes; larger routings sort with torch ops.
KERNEL_SORT_PAIRS = 256
#: Shared memory a kernel's pipeline leaves for Triton's own scratch (layout conversions, reductions).
SMEM_HEADROOM = 16 * 1024


def expert_blocks(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(``rows`` ``[max_blocks · block_m]``: the pair index of each padded row, ``P`` for padding;
    ``block_expert`` ``[max_blocks]``: each block's expert, ``num_experts`` past the last used block), with
    the pairs of ``ids`` ``[T, k]`` (flattened, ``P = T·k``) sorted by expert (stable: a run keeps the
    pairs' order). Device work only: up to ``KERNEL_SORT_PAIRS`` pairs on CUDA one Triton program (a
    decode step's routing; the torch form is some twenty small launches), else torch ops."""
    if use_kernel(ids) and ids.numel() <= KERNEL_SORT_PAIRS:
        return expert_blocks_triton(ids, num_experts, block_m)
    return expert_blocks_torch(ids, num_experts, block_m)


def _max_blocks(pairs: int, num_experts: int, block_m: int) -> int:
    # Each expert in use pads its run by at most block_m - 1 rows, and at most min(P, E) are in use.
    return triton.cdiv(pairs + min(pairs, num_experts) * (block_m - 1), block_m)


def expert_blocks_triton(
    ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`expert_blocks` as one Triton program (at most ``KERNEL_SORT_PAIRS`` pairs)."""
    flat = ids.flatten().contiguous()
    pairs = flat.numel()
    if pairs > KERNEL_SORT_PAIRS:
        raise ValueError(f"the one-program sort takes at most {KERNEL_SORT_PAIRS} pairs, got {pairs}")
    max_blocks = _max_blocks(pairs, num_experts, block_m)
    rows = torch.empty(max_blocks * block_m, dtype=torch.int64, device=ids.device)
    block_expert = torch.empty(max_blocks, dtype=torch.int64, device=ids.device)
    _expert_blocks_kernel[(1,)](
        flat, rows, block_expert, pairs, num_experts, max_blocks,
        BLOCK_P=max(16, next_pow2(pairs)), BLOCK_E=max(16, next_pow2(num_experts)), BLOCK_M=block_m,
        CHUNK=128, num_warps=8,
    )  # fmt: skip
    return rows, block_expert


def expert_blocks_torch(
    ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`expert_blocks` in torch ops (any size, any device)."""
    flat = ids.flatten()
    pairs = flat.numel()
    max_blocks = _max_blocks(pairs, num_experts, block_m)
    # Not bincount: on CUDA it reads the largest id back to the host.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    first_sorted = counts.cumsum(0) - counts  # each expert's first position among the sorted pairs
    rank = torch.arange(pairs, device=flat.device) - first_sorted[expert]
    dest = (padded_end - padded)[expert] + rank
    rows = torch.full((max_blocks * block_m,), pairs, dtype=torch.int64, device=flat.device)
    rows.scatter_(0, dest, order)
    starts = torch.arange(max_blocks, device=flat.device) * block_m
    block_expert = torch.searchsorted(padded_end, starts, right=True)  # num_experts past the end
    return rows, block_expert


@triton.jit
def _expert_blocks_kernel(
    ids_ptr,
    rows_ptr,
    block_expert_ptr,
    num_pairs,
    num_experts,
    max_blocks,
    BLOCK_P: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """:func:`expert_blocks` in one program: counts by comparison (``[E, P]``), each pair's rank among the
    earlier pairs of its expert (``[P, P]``), then every output row and block written once, chunk by
    chunk, from where each pair lands (no scatter, so no ordering between stores to care about)."""
    offs_p = tl.arange(0, BLOCK_P)
    live = offs_p < num_pairs
    expert = tl.load(ids_ptr + offs_p, mask=live, other=num_experts)
    offs_e = tl.arange(0, BLOCK_E)
    hit = (expert[None, :] == offs_e[:, None]).to(tl.int32)  # [E, P]
    counts = tl.sum(hit, 1)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, 0)
    start = tl.sum(hit * (padded_end - padded)[:, None], 0)  # [P]: its expert's first padded row
    earlier = (expert[:, None] == expert[None, :]) & (offs_p[None, :] < offs_p[:, None])  # [P, P]
    dest = tl.where(live, start + tl.sum(earlier.to(tl.int32), 1), -1)
    for r0 in range(0, max_blocks * BLOCK_M, CHUNK):
        r = r0 + tl.arange(0, CHUNK)
        lands = dest[None, :] == r[:, None]  # [CHUNK, P]: at most one pair per row
        row = tl.min(tl.where(lands, offs_p[None, :], num_pairs), 1)
        tl.store(rows_ptr + r, row.to(tl.int64), mask=r < max_blocks * BLOCK_M)
    last = tl.where(offs_e < num_experts, padded_end, 2147483647)  # experts past E never end a run
    for b0 in range(0, max_blocks, CHUNK):
        b = b0 + tl.arange(0, CHUNK)
        # searchsorted(padded_end, b · BLOCK_M, right=True): the experts whose runs end at or before it.
        ended = tl.sum((last[None, :] <= (b * BLOCK_M)[:, None]).to(tl.int32), 1)
        tl.store(block_expert_ptr + b, ended.to(tl.int64), mask=b < max_blocks)


@triton.jit
def _weight_tile(
    ptr,
    mask,
    scale_ptr,
    scale_rows,
    scale_cols,
    mask_s,
    QUANT: tl.constexpr,
    UNIFORM: tl.constexpr,
    ACT8: tl.constexpr,
    DTYPE: tl.constexpr,
    FIX: tl.constexpr,
):
    """A weight tile in the activations' dtype; float8 ones times their tile scales, gathered per element
    unless ``UNIFORM`` (then the caller scales the dot by :func:`_tile_scale`). Where it meets float8
    activations (``ACT8``): kept float8 in a uniform tile, else scaled per element in fp32."""
    w = tl.load(ptr, mask=mask, other=0.0)
    if QUANT and not (ACT8 and UNIFORM):
        if UNIFORM:
            w = cast_to(w.to(tl.float32), DTYPE, FIX)
        else:
            scale = tl.load(scale_ptr + scale_rows + scale_cols, mask=mask_s, other=0.0)
            w = w.to(tl.float32) * scale
            if not ACT8:
                w = cast_to(w, DTYPE, FIX)
    return w


@triton.jit
def _tile_scale(scale_ptr, scale_row, scale_col, QUANT: tl.constexpr, UNIFORM: tl.constexpr):
    """The one scale of a kernel tile that sits inside one quantization tile (1 where none applies)."""
    if QUANT and UNIFORM:
        return tl.load(scale_ptr + scale_row + scale_col)
    else:
        return 1.0


@triton.jit
def _act_dot(
    a, w, xs_rows, rows_ok, k0, offs_k, mask_k, col_offset,
    ACT8: tl.constexpr, UNIFORM: tl.constexpr, BLOCK_COLS: tl.constexpr, FIX: tl.constexpr,
    PREC: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    """``a @ w`` in fp32. With ``ACT8`` ``a`` holds float8 activations whose per-row group scales start at
    ``xs_rows`` (groups of ``BLOCK_COLS`` columns from column ``-col_offset``): where the tile lies in one
    group (``UNIFORM``) both float8 operands meet on the tensor cores and the dot is scaled per row;
    otherwise (a shard's tiles across kernel tiles) each element of both is scaled and the dot runs in
    fp32 (rounding either to the activations' dtype could move a product off the reference's)."""
    if ACT8:
        if UNIFORM:
            scale = tl.load(xs_rows + (k0 + col_offset) // BLOCK_COLS, mask=rows_ok, other=0.0)
            return dot_fp8(a, w, INTERP) * scale[:, None]
        else:
            groups = ((offs_k + col_offset) // BLOCK_COLS)[None, :]
            scale = tl.load(xs_rows[:, None] + groups, mask=rows_ok[:, None] & mask_k[None, :], other=0.0)
            return mma(a.to(tl.float32) * scale, w, False, "tf32x3")
    else:
        return mma(a, w, FIX, PREC)


@triton.jit
def _gate_up_kernel(
    x_ptr,
    w_ptr,
    act_ptr,
    rows_ptr,
    block_expert_ptr,
    scale_ptr,
    xs_ptr,
    num_pairs,
    num_experts,
    hidden,
    inter,
    stride_x,
    stride_xs,
    stride_we,
    stride_wn,
    stride_act,
    stride_se,
    stride_shalf,
    stride_srow,
    stride_scol,
    scale_offset,
    QUANT: tl.constexpr,
    UNIFORM: tl.constexpr,
    ACT8: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PREC: tl.constexpr,
    FIX: tl.constexpr,
    INTERP: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert < num_experts:
        pair = tl.load(rows_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
        live = pair < num_pairs
        token = tl.where(live, pair // TOP_K, 0).to(tl.int64)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < inter
        w = w_ptr + expert.to(tl.int64) * stride_we
        scales = scale_ptr + expert.to(tl.int64) * stride_se
        scale_rows = ((offs_n + scale_offset) // BLOCK_ROWS)[None, :] * stride_srow  # I: the weight's rows
        scale_row = (tl.program_id(1) * BLOCK_N + scale_offset) // BLOCK_ROWS * stride_srow
        dtype: tl.constexpr = act_ptr.dtype.element_ty
        xs_rows = xs_ptr + token * stride_xs
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < hidden
            a = tl.load(
                x_ptr + token[:, None] * stride_x + offs_k[None, :],
                mask=live[:, None] & mask_k[None, :],
                other=0.0,
            )
            wk = mask_k[:, None] & mask_n[None, :]
            scale_cols = (offs_k // BLOCK_COLS)[:, None] * stride_scol
            wg = _weight_tile(
                w + offs_n[None, :] * stride_wn + offs_k[:, None], wk, scales, scale_rows, scale_cols, wk,
                QUANT, UNIFORM, ACT8, dtype, FIX,
            )  # fmt: skip
            wu = _weight_tile(
                w + (inter + offs_n[None, :]) * stride_wn + offs_k[:, None], wk, scales + stride_shalf,
                scale_rows, scale_cols, wk, QUANT, UNIFORM, ACT8, dtype, FIX,
            )  # fmt: skip
            scale_col = k0 // BLOCK_COLS * stride_scol
            acc_g += _act_dot(
                a, wg, xs_rows, live, k0, offs_k, mask_k, 0, ACT8, UNIFORM, BLOCK_COLS, FIX, DOT_PREC, INTERP
            ) * _tile_scale(scales, scale_row, scale_col, QUANT, UNIFORM)  # fmt: skip
            acc_u += _act_dot(
                a, wu, xs_rows, live, k0, offs_k, mask_k, 0, ACT8, UNIFORM, BLOCK_COLS, FIX, DOT_PREC, INTERP
            ) * _tile_scale(scales + stride_shalf, scale_row, scale_col, QUANT, UNIFORM)  # fmt: skip
        act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        out = act_ptr + pair.to(tl.int64)[:, None] * stride_act + offs_n[None, :]
        tl.store(out, cast_to(act, act_ptr.dtype.element_ty, FIX), mask=live[:, None] & mask_n[None, :])


@triton.jit
def _down_kernel(
    act_ptr,
    w_ptr,
    weights_ptr,
    y_ptr,
    rows_ptr,
    block_expert_ptr,
    scale_ptr,
    xs_ptr,
    num_pairs,
    num_experts,
    hidden,
    inter,
    stride_act,
    stride_xs,
    stride_we,
    stride_wn,
    stride_y,
    stride_se,
    stride_srow,
    stride_scol,
    scale_offset,
    QUANT: tl.constexpr,
    UNIFORM: tl.constexpr,
    ACT8: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PREC: tl.constexpr,
    FIX: tl.constexpr,
    INTERP: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert < num_experts:
        pair = tl.load(rows_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
        live = pair < num_pairs
        pair64 = tl.where(live, pair, 0).to(tl.int64)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hidden
        w = w_ptr + expert.to(tl.int64) * stride_we
        scales = scale_ptr + expert.to(tl.int64) * stride_se
        scale_rows = (offs_n // BLOCK_ROWS)[None, :] * stride_srow  # H: the weight's rows
        scale_row = tl.program_id(1) * BLOCK_N // BLOCK_ROWS * stride_srow
        dtype: tl.constexpr = y_ptr.dtype.element_ty
        xs_rows = xs_ptr + pair64 * stride_xs
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < inter
            a = tl.load(
                act_ptr + pair64[:, None] * stride_act + offs_k[None, :],
                mask=live[:, None] & mask_k[None, :],
                other=0.0,
            )
            wk = mask_k[:, None] & mask_n[None, :]
            scale_cols = ((offs_k + scale_offset) // BLOCK_COLS)[:, None] * stride_scol  # I: its columns
            wd = _weight_tile(
                w + offs_n[None, :] * stride_wn + offs_k[:, None], wk, scales, scale_rows, scale_cols, wk,
                QUANT, UNIFORM, ACT8, dtype, FIX,
            )  # fmt: skip
            scale_col = (k0 + scale_offset) // BLOCK_COLS * stride_scol
            acc += _act_dot(
                a, wd, xs_rows, live, k0, offs_k, mask_k, scale_offset, ACT8, UNIFORM, BLOCK_COLS, FIX, DOT_PREC,
                INTERP,
            ) * _tile_scale(scales, scale_row, scale_col, QUANT, UNIFORM)  # fmt: skip
        scale = tl.load(weights_ptr + pair64, mask=live, other=0.0).to(tl.float32)
        out = y_ptr + pair64[:, None] * stride_y + offs_n[None, :]
        tl.store(
            out,
            cast_to(acc * scale[:, None], y_ptr.dtype.element_ty, FIX),
            mask=live[:, None] & mask_n[None, :],
        )


@triton.jit
def _combine_kernel(
    y_ptr,
    add_ptr,
    out_ptr,
    hidden,
    TOP_K: tl.constexpr,
    HAS_ADD: tl.constexpr,
    RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    FIX: tl.constexpr,
    PDL: tl.constexpr,
):
    """``out[t] (+)= Σ_j y[t·k + j] + add[t]`` (the add where given; with ``RESIDUAL`` added to what ``out``
    holds): the sum in fp32 in choice order, each step rounded as the torch sequence rounds it
    (``y.sum(1)``, ``+ add``, ``residual +``)."""
    pdl_start(PDL)
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < hidden
    acc = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(y_ptr + (token * TOP_K + j) * hidden + offs, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    if HAS_ADD:
        acc = cast_to(acc, dtype, FIX).to(tl.float32)
        acc += tl.load(add_ptr + token * hidden + offs, mask=mask, other=0.0).to(tl.float32)
    if RESIDUAL:
        acc = cast_to(acc, dtype, FIX).to(tl.float32)
        acc += tl.load(out_ptr + token * hidden + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * hidden + offs, cast_to(acc, dtype, FIX), mask=mask)


def default_pipeline(block_m: int, block_n: int, x: torch.Tensor, gate_up: torch.Tensor) -> tuple[int, int]:
    """(block_k, num_stages) of both GEMMs: for decode blocks (16 rows) of 16-bit activations 128 columns,
    four loads in flight, where the gate|up kernel's four stages fit one multiprocessor's shared memory
    (144 KiB for bf16 weights, 80 for float8: neither on a GPU with 100 KiB); else 64 columns, three."""
    stage = block_m * 128 * x.element_size() + 2 * 128 * block_n * gate_up.element_size()
    fits = 4 * stage + SMEM_HEADROOM <= shared_memory_per_sm(x.device)
    return (128, 4) if block_m == 16 and x.element_size() == 2 and fits else (64, 3)


def combine_choices(
    y: torch.Tensor,
    top_k: int,
    add: torch.Tensor | None,
    residual: torch.Tensor | None,
    early: bool = True,
) -> torch.Tensor:
    """The launch that sums each token's ``top_k`` weighted choices ``y`` ``[T·k, H]`` (and adds ``add`` and
    the residual: see :func:`fused_moe_triton`); ``early``: whether it may start early (PDL)."""
    tokens, hidden = y.shape[0] // top_k, y.shape[1]
    out = residual if residual is not None else y.new_empty(tokens, hidden)
    _combine_kernel[(tokens, triton.cdiv(hidden, 1024))](
        y, add if add is not None else y, out, hidden, TOP_K=top_k, HAS_ADD=add is not None,
        RESIDUAL=residual is not None, BLOCK=1024, FIX=interp_bf16(y.dtype), num_warps=4,
        **pdl_launch(y, early),
    )  # fmt: skip
    return out


def check_args(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    scales: BlockScales | None,
    add: torch.Tensor | None,
    residual: torch.Tensor | None,
) -> None:
    """Raise ValueError where the arguments of a Triton MoE path do not fit together."""
    if x.stride(-1) != 1 or gate_up.stride(-1) != 1 or down.stride(-1) != 1:
        raise ValueError("x and the expert weights need a contiguous last dimension")
    if (scales is not None) != (gate_up.element_size() == 1 and down.element_size() == 1):
        raise ValueError(f"{gate_up.dtype} experts need block scales exactly when they are float8")
    for name, t in (("add", add), ("residual", residual)):
        if t is not None and (t.shape != x.shape or t.dtype != x.dtype or not t.is_contiguous()):
            raise ValueError(
                f"{name} {tuple(t.shape)} {t.dtype} must be a contiguous {tuple(x.shape)} {x.dtype}"
            )


def fused_moe_triton(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    *,
    scales: BlockScales | None = None,
    add: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int = 64,
    block_k: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
) -> torch.Tensor:
    """The Triton path of ``ops.fused_moe``; float8 experts with ``scales`` are dequantized tile by tile
    (the dots run in the activations' dtype), or meet float8 activations (W8A8, ``scales.fp8_
    activations``); ``add`` ``[T, H]`` is added to the result where given; with
    ``residual`` ``[T, H]`` the result is added
    to it in place and ``residual`` returned (all in the launch that sums the choices); the other keyword
    knobs are for the benchmark.

    Tiles (:func:`default_pipeline`): swept on the H200 (``bench/fused_moe_tiles.py``, 2026-12-03, 16
    calls a graph, each to fresh experts; 64x64x3 -> 64x128x4): Qwen3.5-35B-A3B's experts at batch 1
    34.9 -> 27.3 us, batch 16 227.8 -> 219.1; Moonlight's 43.1 -> 35.8 and 253.4 -> 239.5; DeepSeek-V3's
    182.0 -> 177.3 and 2224 -> 2083, each within 2% of the best of 18 tilings. Block-FP8 experts
    (``--fp8``, 2026-12-04) take the same decode tiles: DeepSeek-V3's at batch 1 176.0 -> 107.1 us
    (44.5% -> 73.2% of the read rate), batch 16 1876 -> 1178 us, the best of 8 tilings (256-column ones
    do not compile). 64-row blocks were not swept."""
    tokens, hidden = x.shape
    top_k = ids.shape[1]
    num_experts, two_inter, _ = gate_up.shape
    inter = two_inter // 2
    pairs = tokens * top_k
    check_args(x, gate_up, down, scales, add, residual)
    if pairs == 0:
        return combine_routed(torch.zeros_like(x), add, residual)
    # Decode batches take the smallest tensor-core tile; larger ones fill bigger blocks per expert.
    bm = block_m or (16 if pairs <= 4 * num_experts else 64)
    default_k, default_stages = default_pipeline(bm, block_n, x, gate_up)
    chosen = block_k is not None or num_stages is not None
    block_k = block_k or default_k
    num_stages = num_stages or default_stages
    rows, block_expert = expert_blocks(ids, num_experts, bm)
    act = x.new_empty(pairs, inter)
    y = x.new_empty(pairs, hidden)
    fix, prec = interp_bf16(x.dtype), dot_precision(x.dtype)
    blocks = block_expert.numel()
    quant = scales is not None
    gu_s = scales.gate_up if quant else x
    d_s = scales.down if quant else x
    block_rows, block_cols = scales.block if quant else (1, 1)
    offset = scales.offset if quant else 0
    # W8A8: x and the activation quantized first (one pass each), on H's tiles and on I's from the offset.
    act8 = quant and scales.fp8_activations
    if act8:
        check_fp8_mma(x.device)
        if block_cols not in (32, 64, 128):
            raise ValueError(f"W8A8 experts take scale tiles of 32, 64 or 128 columns, not {block_cols}")

    def uniform_tiles(block_k: int) -> bool:
        """Every kernel tile inside one quantization tile (gate/up tiles n from the offset by block_n and
        k by block_k; down tiles n by block_n and k from the offset by block_k); W8A8's float8 dots also
        need 32+ columns (the FP8 MMA's K), else the per-element form."""
        inside = block_cols % block_k == 0 and offset % block_n == offset % block_k == 0
        return block_rows % block_n == 0 and inside and not (act8 and block_k < 32)

    uniform = uniform_tiles(block_k)
    if act8 and not uniform and not chosen:
        # fp32 operands per element: the 128-column, four-stage pipeline needs 248 KiB of shared
        # memory (an H100 has 227).
        block_k, num_stages = 64, 3
        uniform = uniform_tiles(block_k)
    x_in, x_s = quantize_activations(x, block_cols) if act8 else (x, x)
    _gate_up_kernel[(blocks, triton.cdiv(inter, block_n))](
        x_in, gate_up, act, rows, block_expert, gu_s, x_s, pairs, num_experts, hidden, inter,
        x_in.stride(0), x_s.stride(0) if act8 else 0, gate_up.stride(0), gate_up.stride(1), act.stride(0),
        gu_s.stride(0) if quant else 0, gu_s.stride(1) if quant else 0, gu_s.stride(2) if quant else 0,
        gu_s.stride(3) if quant else 0, offset,
        QUANT=quant, UNIFORM=uniform, ACT8=act8, BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols, TOP_K=top_k,
        BLOCK_M=bm, BLOCK_N=block_n, BLOCK_K=block_k, DOT_PREC=prec, FIX=fix, INTERP=interpreting(),
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    act_in, act_s = quantize_activations(act, block_cols, offset) if act8 else (act, act)
    _down_kernel[(blocks, triton.cdiv(hidden, block_n))](
        act_in, down, weights.flatten().contiguous(), y, rows, block_expert, d_s, act_s, pairs, num_experts,
        hidden, inter, act_in.stride(0), act_s.stride(0) if act8 else 0, down.stride(0), down.stride(1),
        y.stride(0),
        d_s.stride(0) if quant else 0, d_s.stride(1) if quant else 0, d_s.stride(2) if quant else 0, offset,
        QUANT=quant, UNIFORM=uniform, ACT8=act8, BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols, BLOCK_M=bm,
        BLOCK_N=block_n, BLOCK_K=block_k, DOT_PREC=prec, FIX=fix, INTERP=interpreting(), num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip
    return combine_choices(y, top_k, add, residual)
