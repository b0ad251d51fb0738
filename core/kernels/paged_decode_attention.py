"""Decode attention over the paged KV cache: one query token per row, GQA-aware, split-K.

Cache layout ``[2, num_blocks, block_size, kv_heads, D]`` (k then v); row ``b`` reads its first
``seq_lens[b]`` tokens through ``block_tables[b]``. One program owns one (row, KV head, split): it loads
the query heads of that KV head's group as one tile, so every K/V page is read once per step. A row's
context is cut into ``num_splits`` equal chunks (whole ``BLOCK_N`` tiles); each program writes a
partial (max, sum, unnormalised acc) and a small second kernel merges them. With one split the first
kernel writes the output itself.

With :class:`DecodeRope` the kernel also takes the layer's q/k RMSNorm and rotary and the cache write of
the new token (otherwise the separate ``rope_kv.qk_norm_rope`` kernel): every program normalises and
rotates its group's q heads (into ``out``, which is free scratch until the result lands there), and the
program whose chunk holds the last position normalises and rotates the new k and writes k and v into
their page before it reads the chunk. At batch 1 that saves one dependent launch per layer.

CUDA-graph friendly: no host syncs; the grid depends only on the batch size (a graph bucket) and
``num_splits``, chosen from static maxima, never from the current lengths. Chunk sizes are computed
on the device from ``seq_lens``, so splits without work exit at once. Rows with ``seq_len == 0``
(padding) read nothing and get zeros.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pegainfer.kernels._triton import (
    cast_to,
    dot_precision,
    interp_bf16,
    mma,
    next_pow2,
    num_sms,
    pdl_launch,
    pdl_start,
    tl,
    triton,
    use_kernel,
)
from pegainfer.kernels.rope_kv import _norm_rope_heads, qk_norm_rope_ref
from pegainfer.layers.attention import AttentionMetadata, paged_attention_reference
from pegainfer.layers.rotary import RotaryEmbedding

#: The reduce kernel merges at most this many partials per row; chunks grow beyond it instead.
MAX_SPLITS = 64
#: A split covers at least this many tokens (a split's fixed cost is a q load and a partial write).
MIN_TOKENS_PER_SPLIT = 64


@dataclass(frozen=True)
class DecodeRope:
    """What the decode kernel needs to apply the layer's q/k RMSNorm and rotary itself and write the new
    token into the cache: q is then passed un-normed, and ``k``, ``v`` ``[B, kv_heads, D]`` are the new
    token's (the kernel may overwrite ``k``: it is scratch afterwards); ``positions`` and ``slot_mapping``
    ``[>=B]``."""

    k: torch.Tensor
    v: torch.Tensor
    q_weight: torch.Tensor
    k_weight: torch.Tensor
    rotary: RotaryEmbedding
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    eps: float
    #: The norms' weights are zero-centred (scale ``1 + w`` in fp32, Qwen3.5) rather than plain.
    zero_centred: bool = False


def decode_num_splits(
    batch: int, num_kv_heads: int, max_seq_len: int, device: torch.device | None = None
) -> int:
    """Splits per row from static sizes only (safe under graph capture): enough programs to give every
    multiprocessor about four, never more splits than ``max_seq_len`` has ``MIN_TOKENS_PER_SPLIT``
    chunks, at most ``MAX_SPLITS``."""
    sms = num_sms(device) if device is not None else 132
    wanted = math.ceil(4 * sms / max(1, batch * num_kv_heads))
    by_len = math.ceil(max(1, max_seq_len) / MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, by_len, MAX_SPLITS))


def decode_workspace_bytes(max_num_seqs: int, num_heads: int, head_dim: int, num_splits: int) -> int:
    """Transient bytes one call allocates for the split partials (for the memory plan); 0 with one split."""
    if num_splits <= 1:
        return 0
    return max_num_seqs * num_heads * num_splits * (head_dim + 2) * 4


@triton.jit
def _gated(o, gate, dtype: tl.constexpr, FIX: tl.constexpr):
    """``o * sigmoid(gate)`` rounded as torch rounds it in ``dtype``: the output, then the sigmoid, then
    their product."""
    sig = cast_to(tl.sigmoid(gate.to(tl.float32)), dtype, FIX).to(tl.float32)
    return cast_to(o, dtype, FIX).to(tl.float32) * sig


@triton.jit
def _decode_partial_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    gate_ptr,
    k_new_ptr,
    v_new_ptr,
    qw_ptr,
    kw_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    slot_ptr,
    scale_log2,
    num_splits,
    num_heads,
    num_kv_heads,
    stride_qb,
    stride_qh,
    stride_cblk,
    stride_ctok,
    stride_chead,
    stride_bt,
    stride_ob,
    stride_oh,
    stride_gb,
    stride_gh,
    stride_kb,
    stride_kh,
    stride_vb,
    stride_vh,
    stride_cos,
    eps,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    ROPE: tl.constexpr,
    ZERO_CENTRED: tl.constexpr,
    GATE: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    REST: tl.constexpr,
    BLOCK_REST: tl.constexpr,
    DOT_PREC: tl.constexpr,
    FIX: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_start(PDL)
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + row)
    chunk = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + offs_h
    mask_h = offs_h < GROUP
    mask_d = offs_d < HEAD_DIM
    mask_hd = mask_h[:, None] & mask_d[None, :]
    row64 = row.to(tl.int64)

    if start < seq_len:
        if ROPE:
            pos = tl.load(pos_ptr + row)
            # This group's heads only (the rest masked as head num_heads): with one split another
            # program's finished output may already sit in the rows of ``out`` beyond them.
            group_heads = tl.where(mask_h, heads, num_heads)
            _norm_rope_heads(
                q_ptr, stride_qb, stride_qh, out_ptr, stride_ob, stride_oh, qw_ptr, cos_ptr, sin_ptr,
                stride_cos, pos, row64, group_heads, num_heads, eps, k_ptr, 0, stride_chead, -1,
                HEAD_DIM, HALF, BLOCK_HALF, REST, BLOCK_REST, False, FIX, ZERO_CENTRED,
            )  # fmt: skip
            if (seq_len - 1 >= start) & (seq_len - 1 < end):
                # The new token's k (rotated in place, its raw value is not needed again) and v go into
                # their page before this program reads it.
                slot = tl.load(slot_ptr + row)
                slot_off = (slot // PAGE) * stride_cblk + (slot % PAGE) * stride_ctok
                one_head = tl.where(offs_h == 0, kvh, num_kv_heads)
                _norm_rope_heads(
                    k_new_ptr, stride_kb, stride_kh, k_new_ptr, stride_kb, stride_kh, kw_ptr, cos_ptr,
                    sin_ptr, stride_cos, pos, row64, one_head, num_kv_heads, eps, k_ptr, slot_off,
                    stride_chead, slot, HEAD_DIM, HALF, BLOCK_HALF, REST, BLOCK_REST, True, FIX,
                    ZERO_CENTRED,
                )  # fmt: skip
                if slot >= 0:
                    v_new = tl.load(v_new_ptr + row64 * stride_vb + kvh * stride_vh + offs_d, mask=mask_d)
                    tl.store(v_ptr + slot_off + kvh.to(tl.int64) * stride_chead + offs_d, v_new, mask=mask_d)
            tl.debug_barrier()
            q = tl.load(
                out_ptr + row64 * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                mask=mask_hd,
                other=0.0,
            )
        else:
            q = tl.load(
                q_ptr + row64 * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_hd,
                other=0.0,
            )
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        table = block_tables_ptr + row64 * stride_bt
        head_off = kvh.to(tl.int64) * stride_chead
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end
            block = tl.load(table + offs_n // PAGE, mask=mask_n, other=0).to(tl.int64)
            tok = block * stride_cblk + (offs_n % PAGE) * stride_ctok + head_off
            k = tl.load(
                k_ptr + tok[None, :] + offs_d[:, None], mask=mask_n[None, :] & mask_d[:, None], other=0.0
            )
            v = tl.load(
                v_ptr + tok[:, None] + offs_d[None, :], mask=mask_n[:, None] & mask_d[None, :], other=0.0
            )
            s = mma(q, k, FIX, DOT_PREC) * scale_log2
            s = tl.where(mask_n[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + mma(cast_to(p, v.dtype, FIX), v, FIX, DOT_PREC)
            m_i = m_new
        if SPLIT:
            part = (row64 * num_heads + heads) * num_splits + split
            tl.store(part_m_ptr + part, m_i, mask=mask_h)
            tl.store(part_l_ptr + part, l_i, mask=mask_h)
            tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=mask_hd)
        else:
            o = acc / l_i[:, None]
            if GATE:
                g_ptrs = gate_ptr + row64 * stride_gb + heads[:, None] * stride_gh + offs_d[None, :]
                o = _gated(o, tl.load(g_ptrs, mask=mask_hd, other=0.0), out_ptr.dtype.element_ty, FIX)
            o_ptrs = out_ptr + row64 * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
            tl.store(o_ptrs, cast_to(o, out_ptr.dtype.element_ty, FIX), mask=mask_hd)
    else:
        if not SPLIT:
            # Only split 0 exists, so this row is padding (seq_len 0): its output is zeros.
            o_ptrs = out_ptr + row64 * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
            zeros = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
            tl.store(o_ptrs, cast_to(zeros, out_ptr.dtype.element_ty, FIX), mask=mask_hd)


@triton.jit
def decode_merge_kernel(
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    seq_lens_ptr,
    out_ptr,
    gate_ptr,
    num_splits,
    num_heads,
    stride_ob,
    stride_oh,
    stride_gb,
    stride_gh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FIX: tl.constexpr,
    PDL: tl.constexpr,
    ALL_SPLITS: tl.constexpr,
    GATE: tl.constexpr,
):
    """Merge the split-K partials of one (row, head) (grid ``[rows, heads]``): ``part_m``/``part_l``
    ``[(row · num_heads + head) · num_splits + split]`` (running max in base 2, sum) and ``part_acc`` (the
    unnormalised ``HEAD_DIM`` outputs at the same index), written for the splits whose ``BLOCK_N``-tile
    chunks of ``seq_lens[row]`` hold keys (``ALL_SPLITS``: every split wrote one, ``seq_lens`` unread),
    into ``out`` (times ``sigmoid(gate)`` with ``GATE``: the output gate of Qwen3.5's attention). A row or
    head without a key (every partial at ``m = -inf``) gets zeros. The MLA decode
    kernel (DeepSeek's plugin) and the split prefill attention write their partials this way too."""
    pdl_start(PDL)
    row = tl.program_id(0)
    head = tl.program_id(1)
    if ALL_SPLITS:
        n_active = num_splits
    else:
        seq_len = tl.load(seq_lens_ptr + row)
        chunk = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
        n_active = tl.cdiv(seq_len, tl.maximum(chunk, 1))
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < n_active
    mask_d = offs_d < HEAD_DIM
    part = (row.to(tl.int64) * num_heads + head) * num_splits + offs_s
    m = tl.load(part_m_ptr + part, mask=mask_s, other=float("-inf"))
    l_s = tl.load(part_l_ptr + part, mask=mask_s, other=0.0)
    m_max = tl.maximum(tl.max(m, 0), -1e30)  # finite even for padding rows, so no inf - inf
    w = tl.where(mask_s, tl.exp2(m - m_max), 0.0)
    denom = tl.sum(w * l_s, 0)
    acc = tl.load(
        part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
        mask=mask_s[:, None] & mask_d[None, :],
        other=0.0,
    )
    o = tl.sum(acc * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)
    if GATE:
        g_ptrs = gate_ptr + row.to(tl.int64) * stride_gb + head * stride_gh + offs_d
        o = _gated(o, tl.load(g_ptrs, mask=mask_d, other=0.0), out_ptr.dtype.element_ty, FIX)
    o_ptrs = out_ptr + row.to(tl.int64) * stride_ob + head * stride_oh + offs_d
    tl.store(o_ptrs, cast_to(o, out_ptr.dtype.element_ty, FIX), mask=mask_d)


def _check(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor) -> None:
    if q.dim() != 3 or cache.dim() != 5 or cache.shape[0] != 2:
        raise ValueError(
            f"expected q [B, heads, D] and cache [2, blocks, block_size, kv_heads, D]; got q {tuple(q.shape)}, "
            f"cache {tuple(cache.shape)}"
        )
    if q.shape[1] % cache.shape[3] or q.shape[2] != cache.shape[4]:
        raise ValueError(
            f"q {tuple(q.shape)} does not fit a cache of {cache.shape[3]} KV heads of dim {cache.shape[4]}"
        )
    if block_tables.shape[0] < q.shape[0] or seq_lens.shape[0] < q.shape[0]:
        raise ValueError(f"block_tables/seq_lens have fewer rows than q ({q.shape[0]})")


def _check_rope(rope: DecodeRope, batch: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
    for name in ("k", "v"):
        t = getattr(rope, name)
        if t.shape[0] < batch or tuple(t.shape[1:]) != (kv_heads, head_dim) or t.stride(-1) != 1:
            raise ValueError(
                f"rope.{name} must be [>={batch}, {kv_heads}, {head_dim}] with a contiguous last dim"
            )
        if t.dtype != dtype:
            raise ValueError(f"rope.{name} is {t.dtype}, the cache {dtype}")
    rot = rope.rotary.rotary_dim
    if rot % 2 or rot > head_dim:
        raise ValueError(f"rotary_dim {rot} must be even and at most head_dim {head_dim}")
    if rope.positions.shape[0] < batch or rope.slot_mapping.shape[0] < batch:
        raise ValueError(f"rope.positions and rope.slot_mapping need at least {batch} rows")


def _check_gate(gate: torch.Tensor, q: torch.Tensor) -> None:
    if gate.shape[0] < q.shape[0] or tuple(gate.shape[1:]) != tuple(q.shape[1:]) or gate.stride(-1) != 1:
        raise ValueError(
            f"gate must be [>={q.shape[0]}, {q.shape[1]}, {q.shape[2]}] with a contiguous last dim"
        )
    if gate.dtype != q.dtype:
        raise ValueError(f"gate is {gate.dtype}, q {q.dtype}")


def paged_decode_attention_triton(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    rope: DecodeRope | None = None,
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """The Triton path of :func:`paged_decode_attention` (any device under ``TRITON_INTERPRET=1``).

    ``block_n`` (tokens per tile), ``num_warps`` and ``num_stages`` are tuning knobs; ``num_splits``
    overrides the heuristic :func:`decode_num_splits`."""
    _check(q, cache, block_tables, seq_lens)
    batch, num_heads, head_dim = q.shape
    page, kv_heads = cache.shape[2], cache.shape[3]
    group = num_heads // kv_heads
    if q.stride(-1) != 1 or cache.stride(-1) != 1 or block_tables.stride(-1) != 1:
        raise ValueError("q, cache and block_tables need a contiguous last dimension")
    if out is None:
        out = torch.empty(batch, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * page
    if num_splits is None:
        num_splits = decode_num_splits(batch, kv_heads, max_seq_len, q.device)
    num_splits = max(1, min(int(num_splits), MAX_SPLITS))
    block_n = block_n or (32 if head_dim > 128 or q.dtype == torch.float32 else 64)
    block_d = next_pow2(head_dim)
    block_h = max(16, next_pow2(group))
    split = num_splits > 1
    if split:
        part_acc = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(2, batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
        part_m, part_l = part_ml[0], part_ml[1]
    else:
        part_acc = part_m = part_l = out  # unused
    k_cache, v_cache = cache[0], cache[1]
    if rope is not None:
        _check_rope(rope, batch, kv_heads, head_dim, cache.dtype)
        half = rope.rotary.rotary_dim // 2
        k_new, v_new, cos, sin = rope.k, rope.v, rope.rotary.cos, rope.rotary.sin
        tensors = (k_new, v_new, rope.q_weight, rope.k_weight, cos, sin, rope.positions, rope.slot_mapping)
    else:
        half, k_new, v_new, cos = 0, q, q, q
        tensors = (q,) * 8
    if out.stride(-1) != 1:
        raise ValueError("out needs a contiguous last dimension")
    if gate is not None:
        _check_gate(gate, q)
    g = gate if gate is not None else out
    _decode_partial_kernel[(batch, kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        part_acc,
        part_m,
        part_l,
        g,
        *tensors,
        scale * math.log2(math.e),
        num_splits,
        num_heads,
        kv_heads,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        g.stride(0),
        g.stride(1),
        k_new.stride(0),
        k_new.stride(1),
        v_new.stride(0),
        v_new.stride(1),
        cos.stride(0),
        rope.eps if rope is not None else 0.0,
        GROUP=group,
        HEAD_DIM=head_dim,
        PAGE=page,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        SPLIT=split,
        ROPE=rope is not None,
        ZERO_CENTRED=rope is not None and rope.zero_centred,
        GATE=gate is not None,
        HALF=half,
        BLOCK_HALF=next_pow2(max(half, 1)),
        REST=head_dim - 2 * half if rope is not None else 0,
        BLOCK_REST=next_pow2(max(head_dim - 2 * half, 1)),
        DOT_PREC=dot_precision(q.dtype),
        FIX=interp_bf16(q.dtype),
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl_launch(q),
    )
    if split:
        decode_merge_kernel[(batch, num_heads)](
            part_acc,
            part_m,
            part_l,
            seq_lens,
            out,
            g,
            num_splits,
            num_heads,
            out.stride(0),
            out.stride(1),
            g.stride(0),
            g.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_S=max(2, next_pow2(num_splits)),
            BLOCK_N=block_n,
            FIX=interp_bf16(q.dtype),
            ALL_SPLITS=False,
            GATE=gate is not None,
            num_warps=4,
            **pdl_launch(q),
        )
    return out


def paged_decode_attention_ref(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    rope: DecodeRope | None = None,
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """The torch reference: :func:`pegainfer.layers.attention.paged_attention_reference` over decode rows only
    (it syncs on ``max(seq_lens)``); padding rows (``seq_len == 0``) give zeros. With ``rope``, first
    ``rope_kv.qk_norm_rope_ref`` with its cache write; with ``gate``, the output times its sigmoid."""
    _check(q, cache, block_tables, seq_lens)
    batch = q.shape[0]
    if gate is not None:
        _check_gate(gate, q)
    if rope is not None:
        q, k = qk_norm_rope_ref(
            q, rope.k, rope.q_weight, rope.k_weight, rope.rotary, rope.positions[:batch], rope.eps,
            kv_cache=cache, v=rope.v, slot_mapping=rope.slot_mapping[:batch], zero_centred=rope.zero_centred,
        )  # fmt: skip
    seq_lens = seq_lens[:batch]
    meta = AttentionMetadata(
        block_size=cache.shape[2],
        slot_mapping=torch.empty(0, dtype=torch.long, device=q.device),
        prefills=[],
        num_prefill_tokens=0,
        num_decodes=batch,
        decode_block_tables=block_tables[:batch],
        decode_seq_lens=seq_lens,
        max_decode_seq_len=int(seq_lens.max()) if batch else 0,
    )
    o = paged_attention_reference(q.contiguous(), cache, meta, scale) if batch else q.new_empty(q.shape)
    o = torch.where((seq_lens > 0)[:, None, None], o, torch.zeros((), dtype=o.dtype, device=o.device))
    if gate is not None:
        o = o * torch.sigmoid(gate[:batch])
    if out is None:
        return o
    out.copy_(o)
    return out


def paged_decode_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    rope: DecodeRope | None = None,
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention: q ``[B, heads, D]`` (bf16/fp16/fp32, last dim contiguous) against the paged
    cache ``[2, blocks, block_size, kv_heads, D]`` of the same dtype, row ``b`` reading ``seq_lens[b]``
    tokens (int32 ``[>=B]``) through ``block_tables[b]`` (int32 ``[>=B, max_blocks]``); returns
    ``[B, heads, D]`` in q's dtype (written into ``out`` when given). Softmax and accumulation in fp32.

    ``num_splits``/``max_seq_len`` set the split-K factor from static sizes (default: the block
    table's capacity), so a captured graph stays valid for any lengths. Triton on CUDA, the torch
    reference elsewhere. With ``rope`` (:class:`DecodeRope`) q comes un-normed and the layer's q/k norm,
    rotary and the new token's cache write happen here. With ``gate`` (``[>=B, heads, D]``, q's dtype) the
    output is ``attention * sigmoid(gate)`` (Qwen3.5's gated attention), in the same kernels."""
    if use_kernel(q):
        return paged_decode_attention_triton(
            q, cache, block_tables, seq_lens, scale, out=out, num_splits=num_splits, max_seq_len=max_seq_len,
            rope=rope, gate=gate,
        )  # fmt: skip
    return paged_decode_attention_ref(q, cache, block_tables, seq_lens, scale, out=out, rope=rope, gate=gate)
