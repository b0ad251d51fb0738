"""MLA's prologue in one launch on CUDA: rotary on the queries' rope channels, RMSNorm of the latent, rotary
on the shared rope key, and the latent cache write. The torch form (``MLAttention._prologue_ref``) is
some twenty small launches a layer (the rotary alone is eighteen), which a batch-1 decode step pays in
latency.

``latent_rope_(q, latent, positions, slots, cache, norm_weight, eps, cos, sin, interleaved)``:

- ``q`` ``[T, H, dn + dr]``: its last ``dr`` channels are rotated in place;
- ``latent`` ``[T, rkv + dr]`` (``kv_a_proj_with_mqa``'s output): its first ``rkv`` values are
  RMSNormed with ``norm_weight`` (transformers' order: the normed value rounded to the dtype, then the
  weight), the last ``dr`` rotated, and the row ``[c | k_pe]`` stored at ``cache.flatten(0, 1)[slot]``
  (``cache`` ``[blocks, block_size, rkv + dr]``; a negative slot is skipped); ``latent`` is left as is;
- ``cos``/``sin`` ``[positions, dr / 2]`` fp32 (``PairedRotaryEmbedding``'s tables); ``interleaved``
  pairs channels (2i, 2i + 1), else (i, i + dr / 2).

The rotation runs in fp32 and rounds once (the torch form rounds the tables and each product to the
dtype first), so bf16 results differ from it by a rounding. No host sync: graph-safe.
"""

from __future__ import annotations

import torch

from pegainfer.kernels._triton import cast_to, interp_bf16, next_pow2, tl, triton


@triton.jit
def _rotate_pairs(base, ia, ib, mask, cos, sin, out_base, FIX: tl.constexpr):
    a = tl.load(base + ia, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(base + ib, mask=mask, other=0.0).to(tl.float32)
    dtype = out_base.dtype.element_ty
    tl.store(out_base + ia, cast_to(a * cos - b * sin, dtype, FIX), mask=mask)
    tl.store(out_base + ib, cast_to(b * cos + a * sin, dtype, FIX), mask=mask)


@triton.jit
def _latent_rope_kernel(
    q_ptr,
    latent_ptr,
    positions_ptr,
    slots_ptr,
    cache_ptr,
    weight_ptr,
    cos_ptr,
    sin_ptr,
    eps,
    num_heads,
    stride_qt,
    stride_qh,
    stride_lt,
    stride_cblk,
    stride_ctok,
    stride_table,
    DN: tl.constexpr,
    RKV: tl.constexpr,
    DR: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    FIX: tl.constexpr,
):
    # Program 0 of a token writes its latent row; the others each rotate one block of its query heads,
    # so no program walks every head in turn (a batch-1 step has one token).
    token = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    position = tl.load(positions_ptr + token).to(tl.int64)
    half = tl.arange(0, DR // 2)
    cos = tl.load(cos_ptr + position * stride_table + half)
    sin = tl.load(sin_ptr + position * stride_table + half)
    if INTERLEAVED:
        ia, ib = 2 * half, 2 * half + 1
    else:
        ia, ib = half, half + DR // 2
    if part > 0:
        heads = (part - 1) * BLOCK_H + tl.arange(0, BLOCK_H)
        rope = q_ptr + token * stride_qt + heads[:, None] * stride_qh + DN
        mask = (heads < num_heads)[:, None] & (half < DR // 2)[None, :]
        _rotate_pairs(rope, ia[None, :], ib[None, :], mask, cos[None, :], sin[None, :], rope, FIX)
    else:
        slot = tl.load(slots_ptr + token).to(tl.int64)
        if slot >= 0:
            row = cache_ptr + slot // PAGE * stride_cblk + slot % PAGE * stride_ctok
            offs = tl.arange(0, BLOCK_R)
            mask_r = offs < RKV
            c = tl.load(latent_ptr + token * stride_lt + offs, mask=mask_r, other=0.0).to(tl.float32)
            normed = cast_to(c * tl.rsqrt(tl.sum(c * c, 0) / RKV + eps), latent_ptr.dtype.element_ty, FIX)
            weight = tl.load(weight_ptr + offs, mask=mask_r, other=0.0).to(tl.float32)
            dtype = cache_ptr.dtype.element_ty
            tl.store(row + offs, cast_to(normed.to(tl.float32) * weight, dtype, FIX), mask=mask_r)
            every = half < DR // 2
            _rotate_pairs(latent_ptr + token * stride_lt + RKV, ia, ib, every, cos, sin, row + RKV, FIX)


def latent_rope_(
    q: torch.Tensor,
    latent: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    cache: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool,
) -> None:
    """See the module docstring."""
    tokens, heads, q_dim = q.shape
    dr = 2 * cos.shape[-1]
    rkv = latent.shape[-1] - dr
    if q.stride(-1) != 1 or latent.stride(-1) != 1 or cache.stride(-1) != 1 or cos.stride(-1) != 1:
        raise ValueError("q, latent, cache and the tables need a contiguous last dimension")
    if cache.shape[-1] != rkv + dr or norm_weight.numel() != rkv or dr & (dr - 1):
        raise ValueError(f"cache {tuple(cache.shape)}, norm {norm_weight.numel()} and rope {dr} do not fit")
    if tokens == 0:
        return
    block_h = min(16, next_pow2(heads))
    _latent_rope_kernel[(tokens, 1 + triton.cdiv(heads, block_h))](
        q, latent, positions, slots, cache, norm_weight, cos, sin, eps, heads, q.stride(0), q.stride(1),
        latent.stride(0), cache.stride(0), cache.stride(1), cos.stride(0),
        DN=q_dim - dr, RKV=rkv, DR=dr, PAGE=cache.shape[1], BLOCK_R=next_pow2(rkv),
        BLOCK_H=block_h, INTERLEAVED=interleaved, FIX=interp_bf16(q.dtype), num_warps=4,
    )  # fmt: skip
