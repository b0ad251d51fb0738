"""Attention-input kernels of a decoder layer, each beside its torch reference.

- :func:`qk_norm_rope`: per-head q/k RMSNorm then rotary (half-split), optionally also storing the
  rotated k and v into the paged cache;
- :func:`write_kv`: k, v into the pages by slot mapping (reshape-and-cache).

The kernels round where the torch reference rounds (every op of the reference returns the input dtype),
so in bf16 they match it to about one ulp rather than to bf16 noise. A program reads its whole row
before writing it, so outputs may alias inputs where a docstring says so.
"""

from __future__ import annotations

import torch

from pegainfer.kernels._triton import (
    cast_to,
    interp_bf16,
    next_pow2,
    pdl_launch,
    pdl_start,
    tl,
    triton,
    use_kernel,
    warps_for,
)
from pegainfer.layers.attention import write_kv as write_kv_ref
from pegainfer.layers.norm import rms_norm as rms_norm_ref
from pegainfer.layers.norm import rms_norm_zero_centred as rms_norm_zero_centred_ref
from pegainfer.layers.rotary import RotaryEmbedding

# ---------------------------------------------------------------------- per-head q/k RMSNorm + rotary


@triton.jit
def _rnd(x, dtype: tl.constexpr, FIX: tl.constexpr):
    return cast_to(x, dtype, FIX).to(tl.float32)


@triton.jit
def _scale(normed, w, dtype: tl.constexpr, FIX: tl.constexpr, ZERO_CENTRED: tl.constexpr):
    """The norm's scale of the fp32 ``normed`` values, rounded as the torch reference rounds."""
    if ZERO_CENTRED:
        return _rnd(normed * (1.0 + w), dtype, FIX)
    return _rnd(_rnd(normed, dtype, FIX) * w, dtype, FIX)


@triton.jit
def _norm_rope_heads(
    x_ptr,
    stride_xt,
    stride_xh,
    o_ptr,
    stride_ot,
    stride_oh,
    w_ptr,
    cos_ptr,
    sin_ptr,
    stride_cos,
    pos,
    tok,
    heads,
    n_heads,
    eps,
    cache_ptr,
    cache_off,
    stride_chead,
    slot,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    REST: tl.constexpr,
    BLOCK_REST: tl.constexpr,
    WRITE: tl.constexpr,
    FIX: tl.constexpr,
    ZERO_CENTRED: tl.constexpr = False,
):
    """RMSNorm + rotary of ``heads`` of one token, rounding where the torch reference rounds. With
    ``ZERO_CENTRED`` the norm's scale is ``1 + w``, applied in fp32 before the one cast (Qwen3.5)."""
    c1 = tl.arange(0, BLOCK_HALF)
    m1 = c1 < HALF
    c3 = 2 * HALF + tl.arange(0, BLOCK_REST)
    m3 = c3 < HEAD_DIM
    mh = heads < n_heads
    mk1 = mh[:, None] & m1[None, :]
    mk3 = mh[:, None] & m3[None, :]
    x_base = x_ptr + tok * stride_xt + heads[:, None] * stride_xh
    o_base = o_ptr + tok * stride_ot + heads[:, None] * stride_oh
    x1 = tl.load(x_base + c1[None, :], mask=mk1, other=0.0)
    dtype = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = tl.load(x_base + HALF + c1[None, :], mask=mk1, other=0.0).to(tl.float32)
    sq = tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)
    if REST > 0:
        x3 = tl.load(x_base + c3[None, :], mask=mk3, other=0.0).to(tl.float32)
        sq += tl.sum(x3 * x3, 1)
    rstd = tl.rsqrt(sq / HEAD_DIM + eps)[:, None]
    # rms_norm: normalise in fp32, round to the dtype, times the weight, round.
    w1 = tl.load(w_ptr + c1, mask=m1, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + HALF + c1, mask=m1, other=0.0).to(tl.float32)[None, :]
    y1 = _scale(x1 * rstd, w1, dtype, FIX, ZERO_CENTRED)
    y2 = _scale(x2 * rstd, w2, dtype, FIX, ZERO_CENTRED)
    # rotary, tables rounded to the dtype: (y1, y2) -> (y1 cos - y2 sin, y2 cos + y1 sin), each op rounded.
    row = pos * stride_cos
    cos1 = _rnd(tl.load(cos_ptr + row + c1, mask=m1, other=0.0), dtype, FIX)[None, :]
    cos2 = _rnd(tl.load(cos_ptr + row + HALF + c1, mask=m1, other=0.0), dtype, FIX)[None, :]
    sin1 = _rnd(tl.load(sin_ptr + row + c1, mask=m1, other=0.0), dtype, FIX)[None, :]
    sin2 = _rnd(tl.load(sin_ptr + row + HALF + c1, mask=m1, other=0.0), dtype, FIX)[None, :]
    o1 = cast_to(_rnd(y1 * cos1, dtype, FIX) + _rnd(-y2 * sin1, dtype, FIX), dtype, FIX)
    o2 = cast_to(_rnd(y2 * cos2, dtype, FIX) + _rnd(y1 * sin2, dtype, FIX), dtype, FIX)
    tl.store(o_base + c1[None, :], o1, mask=mk1)
    tl.store(o_base + HALF + c1[None, :], o2, mask=mk1)
    if REST > 0:
        w3 = tl.load(w_ptr + c3, mask=m3, other=0.0).to(tl.float32)[None, :]
        o3 = cast_to(_scale(x3 * rstd, w3, dtype, FIX, ZERO_CENTRED), dtype, FIX)
        tl.store(o_base + c3[None, :], o3, mask=mk3)
    if WRITE:
        if slot >= 0:
            c_base = cache_ptr + cache_off + heads[:, None] * stride_chead
            ct = cache_ptr.dtype.element_ty
            tl.store(c_base + c1[None, :], o1.to(ct), mask=mk1)
            tl.store(c_base + HALF + c1[None, :], o2.to(ct), mask=mk1)
            if REST > 0:
                tl.store(c_base + c3[None, :], o3.to(ct), mask=mk3)


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    qw_ptr,
    kw_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    q_out_ptr,
    k_out_ptr,
    cache_ptr,
    slot_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    stride_cos,
    stride_ckv,
    stride_cblk,
    stride_ctok,
    stride_chead,
    num_q_heads,
    num_kv_heads,
    eps,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    REST: tl.constexpr,
    BLOCK_REST: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    PAGE: tl.constexpr,
    WRITE_CACHE: tl.constexpr,
    FIX: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_start(PDL)
    # Programs [0, q_blocks) take q heads, the next kv_blocks k heads, the rest (cache writes only) v heads.
    tok = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    q_blocks = tl.cdiv(num_q_heads, BLOCK_HEADS)
    kv_blocks = tl.cdiv(num_kv_heads, BLOCK_HEADS)
    offs_h = tl.arange(0, BLOCK_HEADS)
    pos = tl.load(pos_ptr + tok)
    if WRITE_CACHE:
        slot = tl.load(slot_ptr + tok)
        cache_off = (slot // PAGE) * stride_cblk + (slot % PAGE) * stride_ctok
    else:
        slot = -1
        cache_off = 0
    if hb < q_blocks:
        _norm_rope_heads(
            q_ptr, stride_qt, stride_qh, q_out_ptr, stride_qot, stride_qoh, qw_ptr, cos_ptr, sin_ptr,
            stride_cos, pos, tok, hb * BLOCK_HEADS + offs_h, num_q_heads, eps, cache_ptr, cache_off,
            stride_chead, slot, HEAD_DIM, HALF, BLOCK_HALF, REST, BLOCK_REST, False, FIX,
        )  # fmt: skip
    elif hb < q_blocks + kv_blocks:
        _norm_rope_heads(
            k_ptr, stride_kt, stride_kh, k_out_ptr, stride_kot, stride_koh, kw_ptr, cos_ptr, sin_ptr,
            stride_cos, pos, tok, (hb - q_blocks) * BLOCK_HEADS + offs_h, num_kv_heads, eps, cache_ptr,
            cache_off, stride_chead, slot, HEAD_DIM, HALF, BLOCK_HALF, REST, BLOCK_REST, WRITE_CACHE, FIX,
        )  # fmt: skip
    else:
        if WRITE_CACHE:
            if slot >= 0:
                heads = (hb - q_blocks - kv_blocks) * BLOCK_HEADS + offs_h
                cols = tl.arange(0, BLOCK_D)
                mv = (heads < num_kv_heads)[:, None] & (cols < HEAD_DIM)[None, :]
                v = tl.load(v_ptr + tok * stride_vt + heads[:, None] * stride_vh + cols[None, :], mask=mv)
                c_base = cache_ptr + stride_ckv + cache_off + heads[:, None] * stride_chead
                tl.store(c_base + cols[None, :], v.to(cache_ptr.dtype.element_ty), mask=mv)


def qk_norm_rope_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    rotary: RotaryEmbedding,
    positions: torch.Tensor,
    eps: float,
    *,
    inplace: bool = False,
    kv_cache: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
    block_heads: int = 8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton path of :func:`qk_norm_rope`."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    rot = rotary.rotary_dim
    if rot % 2 or rot > head_dim or k.shape[2] != head_dim or q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError(
            f"qk_norm_rope needs q [T, H, D], k [T, KVH, D] with a contiguous last dim and an even "
            f"rotary_dim <= D; got q {tuple(q.shape)}, k {tuple(k.shape)}, rotary_dim {rot}"
        )
    write_cache = kv_cache is not None
    if write_cache and (v is None or slot_mapping is None or v.stride(-1) != 1 or kv_cache.stride(-1) != 1):
        raise ValueError("writing the cache needs v [T, KVH, D] (contiguous last dim) and slot_mapping [T]")
    q_out = q if inplace else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = k if inplace else torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    cos, sin = rotary.cos, rotary.sin
    block_heads = min(block_heads, next_pow2(max(num_q_heads, num_kv_heads)))
    blocks = triton.cdiv(num_q_heads, block_heads) + triton.cdiv(num_kv_heads, block_heads)
    if write_cache:
        blocks += triton.cdiv(num_kv_heads, block_heads)
    half = rot // 2
    rest = head_dim - rot
    cache_arg = kv_cache if write_cache else q
    v_arg = v if write_cache else k
    _qk_norm_rope_kernel[(num_tokens, blocks)](
        q,
        k,
        v_arg,
        q_weight,
        k_weight,
        cos,
        sin,
        positions,
        q_out,
        k_out,
        cache_arg,
        slot_mapping if write_cache else positions,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v_arg.stride(0),
        v_arg.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        k_out.stride(0),
        k_out.stride(1),
        cos.stride(0),
        kv_cache.stride(0) if write_cache else 0,
        kv_cache.stride(1) if write_cache else 0,
        kv_cache.stride(2) if write_cache else 0,
        kv_cache.stride(3) if write_cache else 0,
        num_q_heads,
        num_kv_heads,
        eps,
        HEAD_DIM=head_dim,
        HALF=half,
        BLOCK_HALF=next_pow2(half),
        REST=rest,
        BLOCK_REST=next_pow2(rest) if rest else 1,
        BLOCK_D=next_pow2(head_dim),
        BLOCK_HEADS=block_heads,
        PAGE=kv_cache.shape[2] if write_cache else 1,
        WRITE_CACHE=write_cache,
        FIX=interp_bf16(q.dtype),
        num_warps=2 if head_dim * block_heads <= 1024 else 4,
        **pdl_launch(q),
    )
    return q_out, k_out


def qk_norm_rope_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    rotary: RotaryEmbedding,
    positions: torch.Tensor,
    eps: float,
    *,
    inplace: bool = False,
    kv_cache: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
    zero_centred: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's reference sequence: ``rms_norm`` per head (``rms_norm_zero_centred`` with
    ``zero_centred``), then ``rotary``, then ``write_kv``."""
    norm = rms_norm_zero_centred_ref if zero_centred else rms_norm_ref
    q_new, k_new = rotary(positions, norm(q, q_weight, eps), norm(k, k_weight, eps))
    if kv_cache is not None:
        write_kv_ref(kv_cache, k_new, v, slot_mapping)
    if inplace:
        return q.copy_(q_new), k.copy_(k_new)
    return q_new, k_new


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    rotary: RotaryEmbedding,
    positions: torch.Tensor,
    eps: float,
    *,
    inplace: bool = False,
    kv_cache: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's q/k path in one kernel: RMSNorm of every head of q ``[T, H, D]`` and k ``[T, KVH, D]``
    (weights ``[D]``), then half-split rotary at ``positions`` ``[T]`` (int64) from ``rotary``'s fp32
    tables. q/k may be strided views (e.g. of the packed qkv output) with a contiguous last dim.
    Returns ``(q_out, k_out)``: new contiguous tensors, or q and k themselves with ``inplace``.

    With ``kv_cache`` ``[2, blocks, block_size, KVH, D]``, ``v`` ``[T, KVH, D]`` and ``slot_mapping``
    ``[T]`` (int64), the rotated k and v are also stored at their slots (negative slots are skipped),
    which replaces a separate :func:`write_kv`."""
    if use_kernel(q):
        return qk_norm_rope_triton(
            q, k, q_weight, k_weight, rotary, positions, eps,
            inplace=inplace, kv_cache=kv_cache, v=v, slot_mapping=slot_mapping,
        )  # fmt: skip
    return qk_norm_rope_ref(
        q, k, q_weight, k_weight, rotary, positions, eps,
        inplace=inplace, kv_cache=kv_cache, v=v, slot_mapping=slot_mapping,
    )  # fmt: skip


# ---------------------------------------------------------------------------------- KV write by slot


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ckv,
    stride_cblk,
    stride_ctok,
    stride_chead,
    num_kv_heads,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok)
    if slot >= 0:
        heads = tl.arange(0, BLOCK_H)
        cols = tl.arange(0, BLOCK_D)
        mask = (heads < num_kv_heads)[:, None] & (cols < HEAD_DIM)[None, :]
        dst = cache_ptr + (slot // PAGE) * stride_cblk + (slot % PAGE) * stride_ctok
        dst = dst + heads[:, None] * stride_chead + cols[None, :]
        k = tl.load(k_ptr + tok * stride_kt + heads[:, None] * stride_kh + cols[None, :], mask=mask)
        v = tl.load(v_ptr + tok * stride_vt + heads[:, None] * stride_vh + cols[None, :], mask=mask)
        tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + stride_ckv, v.to(cache_ptr.dtype.element_ty), mask=mask)


def write_kv_triton(
    cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """The Triton path of :func:`write_kv`."""
    num_tokens, kv_heads, head_dim = k.shape
    if v.shape != k.shape or cache.shape[3:] != (kv_heads, head_dim):
        raise ValueError(f"k {tuple(k.shape)}, v {tuple(v.shape)} do not fit cache {tuple(cache.shape)}")
    if k.stride(-1) != 1 or v.stride(-1) != 1 or cache.stride(-1) != 1:
        raise ValueError("k, v and cache need a contiguous last dimension")
    if num_tokens == 0:
        return
    block_h, block_d = next_pow2(kv_heads), next_pow2(head_dim)
    _write_kv_kernel[(num_tokens,)](
        k, v, cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3),
        kv_heads,
        HEAD_DIM=head_dim, PAGE=cache.shape[2], BLOCK_H=block_h, BLOCK_D=block_d,
        num_warps=warps_for(block_h * block_d),
    )  # fmt: skip


def write_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store k, v ``[T, kv_heads, D]`` (strided views allowed, contiguous last dim) into the paged cache
    ``[2, blocks, block_size, kv_heads, D]`` at ``slot_mapping`` ``[T]`` (int64 flat slots, cast to the
    cache dtype); the kernel skips negative slots (padding tokens), the reference on the CPU only."""
    if use_kernel(cache):
        write_kv_triton(cache, k, v, slot_mapping)
    else:
        write_kv_ref(cache, k, v, slot_mapping)
