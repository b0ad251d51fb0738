"""Triton kernels of the Gated DeltaNet decode step and of short prefill chunks, each checked against
``delta_rule.py`` / ``norms.py``.

A decode step of a GDN layer between its two GEMMs is two launches for all decode rows:

1. :func:`conv_update`: the causal depthwise conv of one token per row, continuing from the row's conv
   window in its state slot (the window is shifted in place), then SiLU. One program per (row, channel
   block). It cannot live in the recurrence kernel: the value heads sharing a key head would all read
   and shift that head's q/k windows, and one program might read a window another already shifted.
   (Run as in_proj's epilogue instead, it measured slower: docs/benchmarks.md, thirtieth session.)
2. :func:`gdn_decode`: per (row, value head): the gating (``beta = sigmoid(b)``,
   ``g = -exp(A_log) * softplus(a + dt_bias)``), q/k L2 norm (q also scaled by dk^-0.5), the delta-rule
   update of the slot's fp32 state in place, ``o = S^T q``, and the gated RMSNorm with ``z`` — so its
   output is what ``out_proj`` reads (with ``norm=False`` the un-normed ``o``: a one-row step's
   ``out_proj`` GEMV applies the norm). (vLLM runs the conv, the recurrence with gating and l2 norm, and
   the gated norm as three launches.)

Both read every row's state slot from a device tensor (``slots[row]``) and take fixed-address buffers, so a
CUDA graph captures them as they are: no host sync, no data-dependent shape. A row whose slot is
negative is skipped (no state read or written), and so is a row ``r > 0`` whose slot equals row 0's: the
padding rows of a CUDA-graph bucket replicate row 0, and an in-place update must happen once. (Their
outputs are still computed, from zeros, so they stay finite; they differ from row 0's, which is why a
padding row writes no cache page either.)

Short prefill segments (a prompt's tail after a prefix hit) take the same two steps over every segment
at once: :func:`conv_prefill` (one program per (segment, channel block) walks its segment, so the window
it reads is the one it then replaces) and :func:`gdn_prefill`, the decode step applied to each token of
a segment in turn, the state held in registers from the first token to the last. That is a chain of
dependent steps, so it serves short segments; fla's chunked kernels take long ones.

:func:`gated_rms_norm` is the same norm as a kernel of its own, for rows the delta-rule kernels did not
normalise (fla's prefill rows, and programs narrower than a head).

Rounding follows the torch reference: the conv output and SiLU in the model dtype, ``beta`` rounded to
the model dtype, the delta rule in fp32, ``o`` rounded before the gated norm, which rounds where
``norms.gated_rms_norm`` does.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from pegainfer.kernels._triton import (
    PDL_RELEASE_FIRST,
    cast_to,
    interp_bf16,
    next_pow2,
    num_sms,
    pdl_launch,
    pdl_start,
    tl,
    triton,
)

#: :func:`gdn_decode` reads its state tiles before its PDL wait (``PEGAINFER_GDN_STATE_EARLY=0`` turns it
#: off): Qwen3.5-35B-A3B's batch-1 step 3.090 -> 3.074 ms on an H100, two rounds each; the 9B's unchanged
#: (docs/benchmarks.md, twenty-ninth session).
GDN_STATE_EARLY = os.environ.get("PEGAINFER_GDN_STATE_EARLY", "1") != "0"


def _check_rows(x: torch.Tensor, name: str) -> None:
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"{name} must be [rows, width] with a contiguous last dim, got {tuple(x.shape)}")


@dataclass(frozen=True)
class Checkpoints:
    """States the prefill kernels also save inside their segments: for ``j < counts[s]``, the state after
    segment ``s``'s first ``tokens[s] + j`` tokens into slot ``slots[s] + j`` of ``pool`` (a snapshot pool
    laid out as the state pool it copies). ``tokens[s] = -1``: no saves; ``tokens[s] + j`` may be 0 (the
    state before the segment) or the segment's length (its final state); saves past its end are skipped.
    Device tensors, so a launch needs no host sync."""

    tokens: torch.Tensor  # [segments] int64
    slots: torch.Tensor  # [segments] int64
    counts: torch.Tensor  # [segments] int64
    pool: torch.Tensor


def _checkpoint_args(
    checkpoints: Checkpoints | None, state: torch.Tensor, segments: int, fallback: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernels' (tokens, slots, counts, pool) arguments; without checkpoints, unread stand-ins."""
    if checkpoints is None:
        return fallback, fallback, fallback, state
    pool = checkpoints.pool
    if pool.shape[1:] != state.shape[1:] or pool.stride() != state.stride() or pool.dtype != state.dtype:
        raise ValueError(
            f"checkpoints: a pool {tuple(pool.shape)} not laid out as the state {tuple(state.shape)}"
        )
    per_segment = (checkpoints.tokens, checkpoints.slots, checkpoints.counts)
    if any(t.shape[0] < segments or t.stride(0) != 1 or t.dtype != torch.int64 for t in per_segment):
        raise ValueError(
            f"checkpoints: tokens, slots and counts need {segments} contiguous int64 entries, one per segment"
        )
    return (*per_segment, pool)


# ------------------------------------------------------------------------------------------------ conv


@triton.jit
def _owns_slot(row, slot, first):
    """Whether ``row`` updates its slot: a valid slot, and not a padding copy of row 0 (see above)."""
    valid = (slot >= 0).to(tl.int32)
    distinct = tl.maximum((row == 0).to(tl.int32), (slot != first).to(tl.int32))
    return (valid * distinct) != 0


@triton.jit
def _and(mask, flag):
    """``mask & flag`` for a block ``mask`` and a scalar ``flag`` (the flag broadcast first: the
    interpreter turns a block-and-scalar ``&`` into int32, which it refuses as a mask)."""
    return mask & (tl.zeros_like(mask) | flag)


@triton.jit
def _conv_update_kernel(
    x_ptr,
    stride_x,
    w_ptr,
    win_ptr,
    stride_win_slot,
    stride_win_c,
    slot_ptr,
    out_ptr,
    stride_o,
    channels,
    K: tl.constexpr,
    BLOCK_C: tl.constexpr,
    FIX: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = cols < channels
    slot = tl.load(slot_ptr + row).to(tl.int64)
    first = tl.load(slot_ptr).to(tl.int64)
    owns = _and(mask, _owns_slot(row, slot, first))
    win = win_ptr + tl.maximum(slot, 0) * stride_win_slot + cols * stride_win_c
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    dtype = x.dtype
    x = x.to(tl.float32)
    acc = tl.load(w_ptr + cols * K + (K - 1), mask=mask, other=0.0).to(tl.float32) * x
    for j in tl.static_range(K - 1):
        old = tl.load(win + j, mask=owns, other=0.0)
        acc += tl.load(w_ptr + cols * K + j, mask=mask, other=0.0).to(tl.float32) * old
    y = cast_to(acc, dtype, FIX).to(tl.float32)
    y = y / (1.0 + tl.exp(-y))
    tl.store(out_ptr + row * stride_o + cols, cast_to(y, dtype, FIX), mask=mask)
    # Shift the window: entry j takes entry j + 1 (read before it is overwritten), the last the new input.
    for j in tl.static_range(K - 2):
        tl.store(win + j, tl.load(win + j + 1, mask=owns, other=0.0), mask=owns)
    tl.store(win + (K - 2), x, mask=owns)


def conv_update(
    x: torch.Tensor, weight: torch.Tensor, windows: torch.Tensor, slots: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """``silu(causal_conv_step(x, weight, windows[slots]))`` into ``out`` ``[B, C]``; each row's window
    ``windows[slots[row]]`` (``[C, K-1]``, fp32) is shifted in place (see the module docstring for the
    rows skipped). x ``[B, C]`` (a view with a row stride is fine), weight ``[C, K]``."""
    _check_rows(x, "x")
    _check_rows(out, "out")
    b, c = x.shape
    k = weight.shape[1]
    if weight.shape[0] != c or windows.shape[1:] != (c, k - 1) or windows.stride(2) != 1 or k < 2:
        raise ValueError(
            f"conv_update: x {tuple(x.shape)}, weight {tuple(weight.shape)}, windows {tuple(windows.shape)}"
        )
    if windows.dtype != torch.float32 or not weight.is_contiguous() or slots.shape[0] < b:
        raise ValueError("conv_update: fp32 windows, a contiguous weight and a slot per row are required")
    if b == 0:
        return out
    block = min(256, next_pow2(c))
    _conv_update_kernel[(b, triton.cdiv(c, block))](
        x,
        x.stride(0),
        weight,
        windows,
        windows.stride(0),
        windows.stride(1),
        slots,
        out,
        out.stride(0),
        c,
        K=k,
        BLOCK_C=block,
        FIX=interp_bf16(x.dtype),
        num_warps=4 if block >= 256 else 2,
        **pdl_launch(x),
    )
    return out


@triton.jit
def _inputs_at(x_ptr, stride_x, cols, win, start, pos, mask, has_slot, K: tl.constexpr):
    """The conv inputs at positions ``pos`` of a segment starting at row ``start`` (fp32, masked by
    ``mask``): x's rows where they are in the chunk, else entries ``pos - start + K - 1`` of the window
    ``win`` (the K-1 inputs before the chunk; zeros without a slot)."""
    in_x = (pos >= start)[:, None]
    xv = tl.load(x_ptr + pos[:, None] * stride_x + cols[None, :], mask=mask & in_x, other=0.0)
    wv = tl.load(win + (pos - start + K - 1)[:, None], mask=_and(mask & ~in_x, has_slot), other=0.0)
    return xv.to(tl.float32) + wv


@triton.jit
def _window_before(
    x_ptr, stride_x, cols, mask_c, win, start, at, has_slot, K: tl.constexpr, BLOCK_W: tl.constexpr
):
    """The K-1 inputs before position ``at`` (``[BLOCK_W, BLOCK_C]``, rows past K-1 masked) and their mask."""
    mask = (tl.arange(0, BLOCK_W) < K - 1)[:, None] & mask_c[None, :]
    pos = at - (K - 1) + tl.arange(0, BLOCK_W)
    return _inputs_at(x_ptr, stride_x, cols, win, start, pos, mask, has_slot, K), mask


@triton.jit
def _conv_prefill_kernel(
    x_ptr,
    stride_x,
    w_ptr,
    win_ptr,
    stride_win_slot,
    stride_win_c,
    cu_ptr,
    slot_ptr,
    ckpt_tokens_ptr,
    ckpt_slot_ptr,
    ckpt_count_ptr,
    snap_ptr,
    out_ptr,
    stride_o,
    channels,
    K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_W: tl.constexpr,
    HAS_CKPT: tl.constexpr,
    FIX: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_start(PDL)
    seg = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = cols < channels
    start = tl.load(cu_ptr + seg)
    end = tl.load(cu_ptr + seg + 1)
    slot = tl.load(slot_ptr + seg).to(tl.int64)
    has_slot = slot >= 0
    win = win_ptr + tl.maximum(slot, 0) * stride_win_slot + cols[None, :] * stride_win_c
    dtype = x_ptr.dtype.element_ty
    for t0 in range(start, end, BLOCK_T):
        rows = t0 + tl.arange(0, BLOCK_T)
        mask = (rows < end)[:, None] & mask_c[None, :]
        acc = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
        for j in tl.static_range(K):
            inputs = _inputs_at(x_ptr, stride_x, cols, win, start, rows - (K - 1) + j, mask, has_slot, K)
            w = tl.load(w_ptr + cols * K + j, mask=mask_c, other=0.0).to(tl.float32)
            acc += w[None, :] * inputs
        y = cast_to(acc, dtype, FIX).to(tl.float32)
        y = y / (1.0 + tl.exp(-y))
        tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], cast_to(y, dtype, FIX), mask=mask)
    if HAS_CKPT:  # the windows after the segment's first tokens + j inputs, into snapshot slots + j
        tokens = tl.load(ckpt_tokens_ptr + seg)
        if tokens >= 0:
            snap = snap_ptr + tl.load(ckpt_slot_ptr + seg).to(tl.int64) * stride_win_slot
            saves = tl.minimum(tl.load(ckpt_count_ptr + seg), end - start - tokens + 1)  # none past the end
            for j in range(0, saves):
                saved, mask = _window_before(
                    x_ptr, stride_x, cols, mask_c, win, start, start + tokens + j, has_slot, K, BLOCK_W
                )
                at = snap + j * stride_win_slot + cols[None, :] * stride_win_c
                tl.store(at + tl.arange(0, BLOCK_W)[:, None], saved, mask=mask)
    # The new window: the last K-1 inputs, read (old entries included, for a chunk shorter than K-1)
    # before any is overwritten.
    new, mask = _window_before(x_ptr, stride_x, cols, mask_c, win, start, end, has_slot, K, BLOCK_W)
    tl.debug_barrier()  # every thread's reads of the old window come first
    tl.store(win + tl.arange(0, BLOCK_W)[:, None], new, mask=_and(mask, has_slot))


def conv_prefill(
    x: torch.Tensor,
    weight: torch.Tensor,
    windows: torch.Tensor,
    slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
    out: torch.Tensor,
    checkpoints: Checkpoints | None = None,
) -> torch.Tensor:
    """``silu(causal_conv_prefill(...))`` of every prefill segment in one launch, into ``out`` ``[P, C]``.

    Segment ``s`` is rows ``[cu_seqlens[s], cu_seqlens[s + 1])`` of x ``[P, C]`` (a view with a row stride
    is fine) continuing from window ``windows[slots[s]]`` (``[C, K-1]`` fp32), which is replaced by the
    segment's last K-1 inputs; a negative slot reads a zero window and writes none. One program per
    (segment, channel block) walks its segment a tile of tokens at a time, so the window is read and
    written by the same program. ``checkpoints`` (its pool: snapshot windows shaped as ``windows``): for
    ``j < counts[s]``, the window after a segment's first ``tokens[s] + j`` inputs is also written to
    snapshot ``slots[s] + j`` (see :class:`Checkpoints`)."""
    _check_rows(x, "x")
    _check_rows(out, "out")
    c = x.shape[1]
    k = weight.shape[1]
    if weight.shape[0] != c or windows.shape[1:] != (c, k - 1) or windows.stride(2) != 1 or k < 2:
        raise ValueError(
            f"conv_prefill: x {tuple(x.shape)}, weight {tuple(weight.shape)}, windows {tuple(windows.shape)}"
        )
    if windows.dtype != torch.float32 or not weight.is_contiguous() or out.shape != x.shape:
        raise ValueError("conv_prefill: fp32 windows, a contiguous weight and out shaped as x are required")
    segments = cu_seqlens.shape[0] - 1
    if segments <= 0 or x.shape[0] == 0:
        return out
    if slots.shape[0] < segments:
        raise ValueError(f"conv_prefill: {slots.shape[0]} slots for {segments} segments")
    ckpt = _checkpoint_args(checkpoints, windows, segments, cu_seqlens)
    block = min(64, next_pow2(c))
    _conv_prefill_kernel[(segments, triton.cdiv(c, block))](
        x,
        x.stride(0),
        weight,
        windows,
        windows.stride(0),
        windows.stride(1),
        cu_seqlens,
        slots,
        *ckpt,
        out,
        out.stride(0),
        c,
        K=k,
        BLOCK_T=32,
        BLOCK_C=block,
        BLOCK_W=max(2, next_pow2(k - 1)),
        HAS_CKPT=checkpoints is not None,
        FIX=interp_bf16(x.dtype),
        num_warps=4,
        **pdl_launch(x),
    )
    return out


# ------------------------------------------------------------------------------------------ delta rule


@triton.jit
def _load_qkv(base, hk, hv, key_dim, kcols, vcols, scale, DK: tl.constexpr, DV: tl.constexpr):
    """One token's q, k (L2-normalised with ``delta_rule.l2_normalise``'s epsilon, q scaled) of key head
    ``hk`` and v columns of value head ``hv``."""
    q = tl.load(base + hk * DK + kcols).to(tl.float32)
    k = tl.load(base + key_dim + hk * DK + kcols).to(tl.float32)
    v = tl.load(base + 2 * key_dim + hv * DV + vcols).to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6) * scale
    k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
    return q, k, v


@triton.jit
def _gates(b_row, a_row, hv, a_log_ptr, dt_bias_ptr, FIX: tl.constexpr):
    """One token's ``beta = sigmoid(b)`` (rounded to the model dtype) and decay ``exp(g)`` of head ``hv``."""
    b = tl.load(b_row + hv)
    beta = cast_to(1.0 / (1.0 + tl.exp(-b.to(tl.float32))), b.dtype, FIX).to(tl.float32)
    x = tl.load(a_row + hv).to(tl.float32) + tl.load(dt_bias_ptr + hv).to(tl.float32)
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))
    return beta, tl.exp(-tl.exp(tl.load(a_log_ptr + hv).to(tl.float32)) * softplus)


@triton.jit
def _delta_step(s, q, k, v, beta, decay):
    """The delta rule of one token on the state ``s`` ``[DK, BV]``: the new state and ``o = S^T q``."""
    s = s * decay
    u = beta * (v - tl.sum(s * k[:, None], 0))
    s = s + k[:, None] * u[None, :]
    return s, tl.sum(s * q[:, None], 0)


@triton.jit
def _store_out(
    o, out, z_row, norm_w_ptr, vcols, eps, dtype: tl.constexpr, DV: tl.constexpr, FUSE_NORM: tl.constexpr,
    FIX: tl.constexpr, FIX_OUT: tl.constexpr,
):  # fmt: skip
    """One token's ``o`` columns into ``out``; with ``FUSE_NORM`` (the whole head here) gated-normed by z."""
    if FUSE_NORM:
        o = cast_to(o, dtype, FIX).to(tl.float32)
        n = cast_to(o * tl.rsqrt(tl.sum(o * o, 0) / DV + eps), dtype, FIX).to(tl.float32)
        y = cast_to(tl.load(norm_w_ptr + vcols).to(tl.float32) * n, dtype, FIX).to(tl.float32)
        z = tl.load(z_row + vcols).to(tl.float32)
        tl.store(out, cast_to(y * (z / (1.0 + tl.exp(-z))), out.dtype.element_ty, FIX_OUT))
    else:
        tl.store(out, cast_to(o, out.dtype.element_ty, FIX_OUT))


@triton.jit
def _state_tile(ptr, slot, hv, kcols, vcols, stride_slot, stride_head, stride_k):
    """Pointers of the ``[DK, BV]`` state tile of value head ``hv`` in slot ``slot`` of a pool."""
    return ptr + slot * stride_slot + hv * stride_head + kcols[:, None] * stride_k + vcols[None, :]


@triton.jit
def _gdn_decode_kernel(
    qkv_ptr,
    stride_qkv,
    b_ptr,
    a_ptr,
    stride_ba,
    z_ptr,
    stride_z,
    a_log_ptr,
    dt_bias_ptr,
    state_ptr,
    stride_s_slot,
    stride_s_head,
    stride_s_k,
    slot_ptr,
    norm_w_ptr,
    out_ptr,
    stride_o,
    key_dim,
    heads_per_key,
    scale,
    eps,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BV: tl.constexpr,
    FUSE_NORM: tl.constexpr,
    FIX: tl.constexpr,
    FIX_OUT: tl.constexpr,
    PDL: tl.constexpr,
    STATE_EARLY: tl.constexpr,
):
    """Program (row, value head, value-column block); with ``STATE_EARLY`` the slot ids and the state
    tile are read before the PDL wait (see :func:`gdn_decode`)."""
    if not STATE_EARLY:
        pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1)
    vcols = tl.program_id(2) * BV + tl.arange(0, BV)
    kcols = tl.arange(0, DK)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    first = tl.load(slot_ptr).to(tl.int64)
    owns = _owns_slot(row, slot, first)
    s_ptrs = _state_tile(
        state_ptr, tl.maximum(slot, 0), hv, kcols, vcols, stride_s_slot, stride_s_head, stride_s_k
    )
    owns = _and((kcols[:, None] < DK) & (vcols[None, :] < DV), owns)
    s = tl.load(s_ptrs, mask=owns, other=0.0)  # [DK, BV] fp32
    if STATE_EARLY:
        pdl_start(PDL)

    q, k, v = _load_qkv(
        qkv_ptr + row * stride_qkv, hv // heads_per_key, hv, key_dim, kcols, vcols, scale, DK, DV
    )
    beta, decay = _gates(b_ptr + row * stride_ba, a_ptr + row * stride_ba, hv, a_log_ptr, dt_bias_ptr, FIX)
    s, o = _delta_step(s, q, k, v, beta, decay)
    tl.store(s_ptrs, s, mask=owns)
    _store_out(
        o, out_ptr + row * stride_o + hv * DV + vcols, z_ptr + row * stride_z + hv * DV, norm_w_ptr, vcols,
        eps, b_ptr.dtype.element_ty, DV, FUSE_NORM, FIX, FIX_OUT,
    )  # fmt: skip


def decode_tiles(rows: int, value_heads: int, dv: int, sms: int) -> tuple[int, int]:
    """(value columns per program, warps) of :func:`gdn_decode`. Measured on the H200 at the 9B heads
    (16 key / 32 value heads of 128 x 128; ``python bench/gdn_decode_tiles.py``, 2026-12-04, one call of
    each in a CUDA graph, states from HBM): one program per (row, head) with the gated norm fused in runs
    best at 4 warps, not 8 (batch 1 7.12 -> 5.76 us; batch 64 120.6 -> 80.7 us, 3.3 TB/s of state
    traffic, where 64-column programs and the norm after measured 77.8). Where those programs fill under
    one wave of the multiprocessors (batch 1: 32 for 132), 16-column programs of one warp and the norm
    after take 3.88 us."""
    if rows * value_heads < sms:
        return min(16, dv), 1
    return dv, 4


def gdn_decode(
    qkv: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    z: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    out: torch.Tensor,
    *,
    num_key_heads: int,
    eps: float,
    block_v: int | None = None,
    num_warps: int | None = None,
    norm: bool = True,
) -> torch.Tensor:
    """One delta-rule step of B decode rows, the gated norm included (``norm=False``: left to the
    caller, ``out`` gets the un-normed ``o``); writes ``out`` ``[B, Hv * dv]``.

    qkv ``[B, 2 Hk dk + Hv dv]`` (after the conv and SiLU), b, a ``[B, Hv]``, z ``[B, Hv dv]`` (views of
    the packed projection are fine), a_log, dt_bias ``[Hv]``, norm_weight ``[dv]``, state the layer's
    slot pool ``[slots, Hv, dk, dv]`` fp32, updated in place at ``slots[row]``.

    ``block_v`` and ``num_warps`` (default: :func:`decode_tiles`): value columns per program and its
    warps. Below dv the programs write the un-normed ``o`` and :func:`gated_rms_norm` runs after (two
    launches, more programs for small batches).

    With ``GDN_STATE_EARLY`` each program reads its slot and state tile before its PDL wait, while the conv
    before it still runs. That is safe because a kernel is let in only once the one before it has waited,
    so everything two launches back has finished: the slots and a slot's state are written by the host's
    copies and by this layer's kernels of earlier steps (and, in a mixed step, by prefill kernels on
    other slots), never by the conv launched just before. ``PDL_RELEASE_FIRST`` breaks that chain, so it
    turns the early read off."""
    rows = qkv.shape[0]
    if slots.shape[0] < rows:
        raise ValueError(f"gdn_decode: {slots.shape[0]} slots for {rows} rows")
    tiles = decode_tiles(rows, state.shape[1], state.shape[3], num_sms(state.device))
    return _delta_rule(
        _gdn_decode_kernel, rows, (slots,), qkv, b, a, z, a_log, dt_bias, norm_weight, state, out,
        num_key_heads, eps, block_v or tiles[0], num_warps or (None if block_v else tiles[1]), norm,
        STATE_EARLY=GDN_STATE_EARLY and not PDL_RELEASE_FIRST,
    )  # fmt: skip


#: Value columns per program of :func:`gdn_prefill` (None: the whole head). A segment's tokens are a
#: sequence of dependent steps, so more, narrower programs shorten it (a separate gated norm follows).
PREFILL_BLOCK_V: int | None = 32


def gdn_prefill(
    qkv: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    z: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
    out: torch.Tensor,
    *,
    num_key_heads: int,
    eps: float,
    block_v: int | None = None,
    checkpoints: Checkpoints | None = None,
) -> torch.Tensor:
    """The delta rule over every prefill segment in one launch, token by token (the recurrent form), the
    gated norm included; writes ``out`` ``[P, Hv * dv]``. Inputs as :func:`gdn_decode` with P rows;
    segment ``s`` is rows ``[cu_seqlens[s], cu_seqlens[s + 1])`` and carries ``state[slots[s]]`` from its
    first token to its last (a negative slot starts from zeros and writes nothing back). Each token is
    the decode kernel's step, so a prompt gives what decoding it token by token would. ``checkpoints``
    (its pool: snapshot states shaped as ``state``): for ``j < counts[s]``, the state after a segment's
    first ``tokens[s] + j`` tokens is also written to snapshot ``slots[s] + j`` (see :class:`Checkpoints`)."""
    segments = cu_seqlens.shape[0] - 1
    if slots.shape[0] < segments:
        raise ValueError(f"gdn_prefill: {slots.shape[0]} slots for {segments} segments")
    index = (cu_seqlens, slots, *_checkpoint_args(checkpoints, state, segments, cu_seqlens))
    return _delta_rule(
        _gdn_prefill_kernel, max(segments, 0), index, qkv, b, a, z, a_log, dt_bias, norm_weight, state, out,
        num_key_heads, eps, block_v or PREFILL_BLOCK_V, None, HAS_CKPT=checkpoints is not None,
    )  # fmt: skip


def _delta_rule(
    kernel,
    programs,
    index,
    qkv,
    b,
    a,
    z,
    a_log,
    dt_bias,
    norm_weight,
    state,
    out,
    hk,
    eps,
    block_v,
    warps,
    norm=True,
    **flags,
) -> torch.Tensor:
    """Checks and launches a delta-rule kernel over ``programs`` rows or segments (``index``: the device
    tensors that say which); below a whole head of value columns the gated norm runs after it. Without
    ``norm`` the un-normed ``o`` goes into ``out`` (the caller applies the gated norm)."""
    for t, name in ((qkv, "qkv"), (b, "b"), (a, "a"), (z, "z"), (out, "out")):
        _check_rows(t, name)
    rows = qkv.shape[0]
    _, hv, dk, dv = state.shape
    if qkv.shape[1] != 2 * hk * dk + hv * dv or b.shape[1] != hv or z.shape[1] != hv * dv:
        raise ValueError(
            f"delta rule: qkv {tuple(qkv.shape)}, b {tuple(b.shape)}, z {tuple(z.shape)} do not fit a state "
            f"of {hv} value heads of {dk}x{dv} with {hk} key heads"
        )
    if b.stride(0) != a.stride(0) or state.dtype != torch.float32 or state.stride(3) != 1 or hv % hk:
        raise ValueError("delta rule: b and a must share a row stride; the state must be fp32, dv-contiguous")
    if out.shape != (rows, hv * dv):
        raise ValueError(f"delta rule: out {tuple(out.shape)} for {rows} rows of {hv} x {dv}")
    if rows == 0 or programs == 0:
        return out
    bv = min(block_v or dv, dv)
    fuse = bv == dv and norm
    target = out if fuse or not norm else torch.empty(out.shape, dtype=qkv.dtype, device=out.device)
    kernel[(programs, hv, triton.cdiv(dv, bv))](
        qkv,
        qkv.stride(0),
        b,
        a,
        b.stride(0),
        z,
        z.stride(0),
        a_log,
        dt_bias,
        state,
        state.stride(0),
        state.stride(1),
        state.stride(2),
        *index,
        norm_weight,
        target,
        target.stride(0),
        hk * dk,
        hv // hk,
        dk**-0.5,
        eps,
        DK=dk,
        DV=dv,
        BV=bv,
        FUSE_NORM=fuse,
        FIX=interp_bf16(qkv.dtype),
        FIX_OUT=interp_bf16(target.dtype),
        num_warps=warps or (8 if dk * bv >= 128 * 128 else 4),
        **flags,
        **pdl_launch(qkv),
    )
    if not fuse and norm:
        gated_rms_norm(target.view(rows, hv, dv), z.view(rows, hv, dv), norm_weight, eps, out)
    return out


@triton.jit
def _gdn_prefill_kernel(
    qkv_ptr,
    stride_qkv,
    b_ptr,
    a_ptr,
    stride_ba,
    z_ptr,
    stride_z,
    a_log_ptr,
    dt_bias_ptr,
    state_ptr,
    stride_s_slot,
    stride_s_head,
    stride_s_k,
    cu_ptr,
    slot_ptr,
    ckpt_tokens_ptr,
    ckpt_slot_ptr,
    ckpt_count_ptr,
    snap_ptr,
    norm_w_ptr,
    out_ptr,
    stride_o,
    key_dim,
    heads_per_key,
    scale,
    eps,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BV: tl.constexpr,
    FUSE_NORM: tl.constexpr,
    HAS_CKPT: tl.constexpr,
    FIX: tl.constexpr,
    FIX_OUT: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_start(PDL)
    seg = tl.program_id(0)
    hv = tl.program_id(1)
    hk = hv // heads_per_key
    vcols = tl.program_id(2) * BV + tl.arange(0, BV)
    kcols = tl.arange(0, DK)
    start = tl.load(cu_ptr + seg).to(tl.int64)
    end = tl.load(cu_ptr + seg + 1).to(tl.int64)
    slot = tl.load(slot_ptr + seg).to(tl.int64)
    s_ptrs = _state_tile(
        state_ptr, tl.maximum(slot, 0), hv, kcols, vcols, stride_s_slot, stride_s_head, stride_s_k
    )
    in_tile = (kcols[:, None] < DK) & (vcols[None, :] < DV)
    owns = _and(in_tile, slot >= 0)
    s = tl.load(s_ptrs, mask=owns, other=0.0)  # [DK, BV] fp32, carried through the segment's tokens
    if HAS_CKPT:
        tokens = tl.load(ckpt_tokens_ptr + seg)
        # For j < count the state after row ``saved_at + j`` goes into snapshot ``snap + j``.
        saved_at = start + tokens - 1
        count = tl.where(tokens >= 0, tl.load(ckpt_count_ptr + seg), 0)
        snap = tl.maximum(tl.load(ckpt_slot_ptr + seg).to(tl.int64), 0)
        if (tokens == 0) & (count > 0):  # j = 0 is the state before the segment
            at = _state_tile(snap_ptr, snap, hv, kcols, vcols, stride_s_slot, stride_s_head, stride_s_k)
            tl.store(at, s, mask=in_tile)
    # Each token's inputs are loaded one step ahead, so their latency hides behind the step before (the
    # steps are a dependent chain; the loads are not). An empty segment loads row 0, which always exists.
    t = tl.maximum(tl.minimum(start, end - 1), 0)
    q, k, v = _load_qkv(qkv_ptr + t * stride_qkv, hk, hv, key_dim, kcols, vcols, scale, DK, DV)
    beta, decay = _gates(b_ptr + t * stride_ba, a_ptr + t * stride_ba, hv, a_log_ptr, dt_bias_ptr, FIX)
    for t in range(start, end):
        ahead = tl.minimum(t + 1, end - 1)  # the last token loads itself again, unused
        q_next, k_next, v_next = _load_qkv(
            qkv_ptr + ahead * stride_qkv, hk, hv, key_dim, kcols, vcols, scale, DK, DV
        )
        beta_next, decay_next = _gates(
            b_ptr + ahead * stride_ba, a_ptr + ahead * stride_ba, hv, a_log_ptr, dt_bias_ptr, FIX
        )
        s, o = _delta_step(s, q, k, v, beta, decay)
        q, k, v, beta, decay = q_next, k_next, v_next, beta_next, decay_next
        if HAS_CKPT:
            j = t - saved_at
            if (j >= 0) & (j < count):  # the tile's pointers built only for a save
                at = _state_tile(
                    snap_ptr, snap + j, hv, kcols, vcols, stride_s_slot, stride_s_head, stride_s_k
                )
                tl.store(at, s, mask=in_tile)
        _store_out(
            o, out_ptr + t * stride_o + hv * DV + vcols, z_ptr + t * stride_z + hv * DV, norm_w_ptr, vcols,
            eps, b_ptr.dtype.element_ty, DV, FUSE_NORM, FIX, FIX_OUT,
        )  # fmt: skip
    tl.store(s_ptrs, s, mask=owns)


# ------------------------------------------------------------------------------------------ gated norm


@triton.jit
def _gated_norm_kernel(
    x_ptr,
    z_ptr,
    w_ptr,
    out_ptr,
    heads,
    stride_x,
    stride_z,
    stride_o,
    eps,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
    FIX: tl.constexpr,
    FIX_OUT: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_start(PDL)
    pid = tl.program_id(0).to(tl.int64)
    row, head = pid // heads, pid % heads
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(x_ptr + row * stride_x + head * D + cols, mask=mask, other=0.0)
    dtype = x.dtype
    x = x.to(tl.float32)
    n = cast_to(x * tl.rsqrt(tl.sum(x * x, 0) / D + eps), dtype, FIX).to(tl.float32)
    y = cast_to(tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) * n, dtype, FIX).to(tl.float32)
    z = tl.load(z_ptr + row * stride_z + head * D + cols, mask=mask, other=0.0).to(tl.float32)
    out = cast_to(y * (z / (1.0 + tl.exp(-z))), out_ptr.dtype.element_ty, FIX_OUT)
    tl.store(out_ptr + row * stride_o + head * D + cols, out, mask=mask)


def gated_rms_norm(
    x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor
) -> torch.Tensor:
    """``norms.gated_rms_norm`` of x, z ``[T, H, D]`` (rows may be strided, heads contiguous) into ``out``
    (``[T, H, D]`` or ``[T, H * D]``)."""
    t, h, d = x.shape
    if z.shape != x.shape or x.stride(2) != 1 or z.stride(2) != 1 or x.stride(1) != d or z.stride(1) != d:
        raise ValueError(f"gated_rms_norm: x {tuple(x.shape)} and z {tuple(z.shape)} need contiguous heads")
    o = out.view(t, h * d)
    if o.stride(1) != 1:
        raise ValueError("gated_rms_norm: out needs contiguous rows")
    if t == 0:
        return out
    _gated_norm_kernel[(t * h,)](
        x,
        z,
        weight,
        o,
        h,
        x.stride(0),
        z.stride(0),
        o.stride(0),
        eps,
        D=d,
        BLOCK=next_pow2(d),
        FIX=interp_bf16(x.dtype),
        FIX_OUT=interp_bf16(out.dtype),
        num_warps=1 if d <= 256 else 4,
        **pdl_launch(x),
    )
    return out


# ------------------------------------------------------------------------------- zero-centred RMSNorm


@triton.jit
def _zero_centred_norm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    heads,
    stride_x0,
    stride_x1,
    stride_o0,
    stride_o1,
    eps,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
    FIX: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_start(PDL)
    pid = tl.program_id(0).to(tl.int64)
    row, head = pid // heads, pid % heads
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(x_ptr + row * stride_x0 + head * stride_x1 + cols, mask=mask, other=0.0)
    dtype = x.dtype
    x = x.to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, 0) / D + eps) * (1.0 + w)
    tl.store(out_ptr + row * stride_o0 + head * stride_o1 + cols, cast_to(y, dtype, FIX), mask=mask)


def rms_norm_zero_centred(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``norms.rms_norm_zero_centred`` of x ``[T, D]`` or ``[T, H, D]`` (any row and head strides, the
    last dim contiguous) into ``out`` (a new contiguous tensor when None; same shape as x)."""
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    x3 = x if x.dim() == 3 else x.unsqueeze(1)
    o3 = out.view(x3.shape) if out.dim() != x3.dim() else out
    if x3.stride(2) != 1 or o3.stride(2) != 1 or x3.dim() != 3 or out.dtype != x.dtype:
        raise ValueError(f"rms_norm_zero_centred: x {tuple(x.shape)} needs a contiguous last dim")
    t, h, d = x3.shape
    if t == 0:
        return out
    _zero_centred_norm_kernel[(t * h,)](
        x3,
        weight,
        o3,
        h,
        x3.stride(0),
        x3.stride(1),
        o3.stride(0),
        o3.stride(1),
        eps,
        D=d,
        BLOCK=next_pow2(d),
        FIX=interp_bf16(x.dtype),
        num_warps=1 if d <= 512 else 4 if d <= 4096 else 8,
        **pdl_launch(x),
    )
    return out
