"""Prefill and chunked-prefill attention over the paged KV cache, several segments in one launch.

Segment ``s`` owns queries ``[q_start[s], q_start[s] + q_len[s])`` of the batch; they are the last
``q_len`` of its ``ctx_len`` tokens, whose K/V (the chunk's own included, written beforehand) sit in
the pages of ``block_tables[s]``. Query ``i`` of the chunk sits at position ``ctx_len - q_len + i`` and
attends to every key at or before it: the cached prefix in full, the chunk causally.

One program owns ``BLOCK_M`` queries of one head of one segment and runs a flash-attention online
softmax (fp32, base 2) over key tiles gathered through the block table: first the tiles wholly before
its first query, with no mask, then the diagonal tiles with the causal mask. Programs of one tile of
all heads are adjacent in launch order so the query heads sharing a KV head read its pages while they
are in L2.
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
    tl,
    triton,
    use_kernel,
)
from pegainfer.kernels.paged_decode_attention import decode_merge_kernel
from pegainfer.layers.attention import AttentionMetadata, PrefillSegment, paged_attention_reference


@dataclass
class PrefillTensors:
    """Device metadata of the prefill segments: int32 ``[S]`` vectors, block tables int32
    ``[S, max_blocks]`` (zero-padded), and ``max_q_len`` on the host (it sizes the grid)."""

    q_start: torch.Tensor
    q_len: torch.Tensor
    ctx_len: torch.Tensor
    block_tables: torch.Tensor
    max_q_len: int
    #: A bound on the segments' context lengths (a CUDA graph's bucket passes the model's): it sizes the
    #: split of the keys over programs (``key_splits``).
    max_ctx_len: int


def prefill_tensors(segments: list[PrefillSegment], device: torch.device | str) -> PrefillTensors:
    """Pack :class:`PrefillSegment` s into :class:`PrefillTensors` on ``device``. The block tables are
    copied where they are (device tables stay on the device: no read back, no sync with the host)."""
    count = len(segments)
    width = max((seg.block_table.numel() for seg in segments), default=1)
    tables = torch.zeros(count, max(1, width), dtype=torch.int32, device=device)
    for i, seg in enumerate(segments):
        tables[i, : seg.block_table.numel()] = seg.block_table
    ints = torch.tensor(
        [[seg.q_start, seg.q_len, seg.ctx_len] for seg in segments] or [[0, 0, 0]], dtype=torch.int32
    )[:count]
    ints = ints.t().contiguous().to(device, non_blocking=True)
    return PrefillTensors(
        q_start=ints[0],
        q_len=ints[1],
        ctx_len=ints[2],
        block_tables=tables,
        max_q_len=max((seg.q_len for seg in segments), default=0),
        max_ctx_len=max((seg.ctx_len for seg in segments), default=0),
    )


#: The fewest keys one program of a split prefill takes, and the most runs the keys are split into.
MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 8


def key_splits(num_heads: int, num_tiles: int, max_ctx_len: int, device: torch.device) -> int:
    """Into how many runs each query tile splits its keys: 1 unless the (head, tile) programs of one
    segment leave most of the GPU idle, as a short chunk over a long cached context does (one program per
    head would walk thousands of keys alone); then enough runs, of at least ``MIN_KEYS_PER_SPLIT`` keys,
    to fill it. Counted for one segment: a step of several segments has more programs anyway."""
    if device.type != "cuda":
        return 1
    by_keys = max_ctx_len // MIN_KEYS_PER_SPLIT
    return max(1, min(MAX_SPLITS, by_keys, num_sms(device) // max(1, num_heads * num_tiles)))


def prefill_workspace_bytes(head_dim: int, device: torch.device) -> int:
    """The most bytes one split call allocates for its partials (for the memory plan): splits happen
    only while heads x tiles x splits stays within the SM count, so the rows x heads x splits partials
    stay within SMs x BLOCK_M."""
    if device.type != "cuda":
        return 0
    largest_block_m = 128  # default_prefill_config's
    return num_sms(device) * largest_block_m * (head_dim + 2) * 4


@triton.jit
def _prefill_tile(
    q,
    m_i,
    l_i,
    acc,
    k_ptr,
    v_ptr,
    table,
    head_off,
    q_pos,
    n0,
    last_pos,
    scale_log2,
    stride_cblk,
    stride_ctok,
    offs_d,
    mask_d,
    MASKED: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
    FIX: tl.constexpr,
):
    offs_n = n0 + tl.arange(0, BLOCK_N)
    if MASKED:
        mask_n = offs_n <= last_pos
        block = tl.load(table + offs_n // PAGE, mask=mask_n, other=0).to(tl.int64)
        tok = block * stride_cblk + (offs_n % PAGE) * stride_ctok + head_off
        k = tl.load(k_ptr + tok[None, :] + offs_d[:, None], mask=mask_n[None, :] & mask_d[:, None], other=0.0)
        v = tl.load(v_ptr + tok[:, None] + offs_d[None, :], mask=mask_n[:, None] & mask_d[None, :], other=0.0)
    else:
        block = tl.load(table + offs_n // PAGE).to(tl.int64)
        tok = block * stride_cblk + (offs_n % PAGE) * stride_ctok + head_off
        k = tl.load(k_ptr + tok[None, :] + offs_d[:, None], mask=mask_d[:, None], other=0.0)
        v = tl.load(v_ptr + tok[:, None] + offs_d[None, :], mask=mask_d[None, :], other=0.0)
    s = mma(q, k, FIX, DOT_PREC) * scale_log2
    if MASKED:
        s = tl.where(offs_n[None, :] <= q_pos[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + mma(cast_to(p, v.dtype, FIX), v, FIX, DOT_PREC)
    return m_new, l_i, acc


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    q_start_ptr,
    q_len_ptr,
    ctx_len_ptr,
    block_tables_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    scale_log2,
    num_tiles,
    num_splits,
    num_heads,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cblk,
    stride_ctok,
    stride_chead,
    stride_bt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PREC: tl.constexpr,
    FIX: tl.constexpr,
    SPLIT: tl.constexpr,
):
    head = tl.program_id(0)
    tile = num_tiles - 1 - tl.program_id(1) // num_splits  # the longest rows of keys start first
    split = tl.program_id(1) % num_splits
    seg = tl.program_id(2)
    q_len = tl.load(q_len_ptr + seg)
    if tile * BLOCK_M < q_len:
        q_start = tl.load(q_start_ptr + seg).to(tl.int64)
        ctx_len = tl.load(ctx_len_ptr + seg)
        offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        mask_m = offs_m < q_len
        mask_d = offs_d < HEAD_DIM
        rows = q_start + offs_m
        q = tl.load(
            q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
            mask=mask_m[:, None] & mask_d[None, :],
            other=0.0,
        )
        first_pos = ctx_len - q_len + tile * BLOCK_M
        last_pos = tl.minimum(first_pos + BLOCK_M, ctx_len) - 1
        q_pos = first_pos + tl.arange(0, BLOCK_M)
        # Keys before this bound precede every query of the tile: no mask needed.
        full_end = ((first_pos + 1) // BLOCK_N) * BLOCK_N
        table = block_tables_ptr + seg.to(tl.int64) * stride_bt
        head_off = (head // GROUP).to(tl.int64) * stride_chead
        # With SPLIT this program takes one of num_splits equal runs of BLOCK_N-tiles of the keys.
        lo, hi = 0, last_pos + 1
        if SPLIT:
            chunk = tl.cdiv(tl.cdiv(hi, num_splits), BLOCK_N) * BLOCK_N
            lo = split * chunk
            hi = tl.minimum(lo + chunk, hi)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for n0 in range(lo, tl.minimum(full_end, hi), BLOCK_N):
            m_i, l_i, acc = _prefill_tile(
                q, m_i, l_i, acc, k_ptr, v_ptr, table, head_off, q_pos, n0, last_pos, scale_log2,
                stride_cblk, stride_ctok, offs_d, mask_d, False, PAGE, BLOCK_N, DOT_PREC, FIX,
            )  # fmt: skip
        for n0 in range(tl.maximum(full_end, lo), hi, BLOCK_N):
            m_i, l_i, acc = _prefill_tile(
                q, m_i, l_i, acc, k_ptr, v_ptr, table, head_off, q_pos, n0, last_pos, scale_log2,
                stride_cblk, stride_ctok, offs_d, mask_d, True, PAGE, BLOCK_N, DOT_PREC, FIX,
            )  # fmt: skip
        if SPLIT:  # the partials in decode_merge_kernel's layout; a run without keys stays at -inf
            part = (rows * num_heads + head) * num_splits + split
            tl.store(part_m_ptr + part, m_i, mask=mask_m)
            tl.store(part_l_ptr + part, l_i, mask=mask_m)
            tl.store(
                part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
                acc,
                mask=mask_m[:, None] & mask_d[None, :],
            )
        else:
            o = acc / l_i[:, None]
            tl.store(
                out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
                cast_to(o, out_ptr.dtype.element_ty, FIX),
                mask=mask_m[:, None] & mask_d[None, :],
            )


def _check(q: torch.Tensor, cache: torch.Tensor) -> None:
    if q.dim() != 3 or cache.dim() != 5 or cache.shape[0] != 2:
        raise ValueError(
            f"expected q [T, heads, D] and cache [2, blocks, block_size, kv_heads, D]; got q {tuple(q.shape)}, "
            f"cache {tuple(cache.shape)}"
        )
    if q.shape[1] % cache.shape[3] or q.shape[2] != cache.shape[4]:
        raise ValueError(
            f"q {tuple(q.shape)} does not fit a cache of {cache.shape[3]} KV heads of dim {cache.shape[4]}"
        )


def default_prefill_config(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for Hopper; the benchmark sweeps alternatives. fp32
    (full-precision dots on the FMA units) takes smaller tiles to stay clear of register spills."""
    if dtype == torch.float32:
        return (64, 32, 4, 2) if head_dim <= 64 else (32, 32, 4, 2)
    if head_dim <= 64:
        return 128, 64, 4, 3
    if head_dim <= 128:
        return 128, 64, 8, 3
    return 64, 32, 8, 2


def paged_prefill_attention_triton(
    q: torch.Tensor,
    cache: torch.Tensor,
    meta: PrefillTensors,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """The Triton path of :func:`paged_prefill_attention`; the keyword knobs override
    :func:`default_prefill_config` and :func:`key_splits`."""
    _check(q, cache)
    num_heads, head_dim = q.shape[1], q.shape[2]
    page, kv_heads = cache.shape[2], cache.shape[3]
    if q.stride(-1) != 1 or cache.stride(-1) != 1 or meta.block_tables.stride(-1) != 1:
        raise ValueError("q, cache and block_tables need a contiguous last dimension")
    if out is None:
        out = torch.empty_like(q)
    num_segments = meta.q_len.shape[0]
    if num_segments == 0 or meta.max_q_len == 0:
        return out
    bm, bn, warps, stages = default_prefill_config(head_dim, q.dtype)
    bm, bn = block_m or bm, block_n or bn
    num_tiles = triton.cdiv(meta.max_q_len, bm)
    splits = (
        key_splits(num_heads, num_tiles, meta.max_ctx_len, q.device) if num_splits is None else num_splits
    )
    k_cache, v_cache = cache[0], cache[1]
    if splits > 1:
        rows = q.shape[0]
        part_acc = torch.empty(rows * num_heads * splits * head_dim, dtype=torch.float32, device=q.device)
        part_m = torch.empty(rows * num_heads * splits, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    else:
        part_acc = part_m = part_l = out  # not read
    _prefill_kernel[(num_heads, num_tiles * splits, num_segments)](
        q,
        k_cache,
        v_cache,
        out,
        meta.q_start,
        meta.q_len,
        meta.ctx_len,
        meta.block_tables,
        part_acc,
        part_m,
        part_l,
        scale * math.log2(math.e),
        num_tiles,
        splits,
        num_heads,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        meta.block_tables.stride(0),
        GROUP=num_heads // kv_heads,
        HEAD_DIM=head_dim,
        PAGE=page,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_D=next_pow2(head_dim),
        DOT_PREC=dot_precision(q.dtype),
        FIX=interp_bf16(q.dtype),
        SPLIT=splits > 1,
        num_warps=num_warps or warps,
        num_stages=num_stages or stages,
    )
    if splits > 1:
        decode_merge_kernel[(q.shape[0], num_heads)](
            part_acc, part_m, part_l, meta.q_len, out, out, splits, num_heads, out.stride(0), out.stride(1),
            0, 0, HEAD_DIM=head_dim, BLOCK_D=next_pow2(head_dim), BLOCK_S=max(2, next_pow2(splits)),
            BLOCK_N=bn, FIX=interp_bf16(q.dtype), PDL=False, ALL_SPLITS=True, GATE=False, num_warps=4,
        )  # fmt: skip
    return out


def paged_prefill_attention_ref(
    q: torch.Tensor,
    cache: torch.Tensor,
    meta: PrefillTensors,
    scale: float,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The torch reference: :func:`pegainfer.layers.attention.paged_attention_reference` over the segments (it
    reads the metadata back to the host)."""
    _check(q, cache)
    starts, lens, ctxs = meta.q_start.tolist(), meta.q_len.tolist(), meta.ctx_len.tolist()
    segments = [
        PrefillSegment(q_start=s, q_len=n, ctx_len=c, block_table=meta.block_tables[i])
        for i, (s, n, c) in enumerate(zip(starts, lens, ctxs, strict=True))
        if n > 0
    ]
    attn = AttentionMetadata(
        block_size=cache.shape[2],
        slot_mapping=torch.empty(0, dtype=torch.long, device=q.device),
        prefills=segments,
        num_prefill_tokens=q.shape[0],
    )
    result = paged_attention_reference(q.contiguous(), cache, attn, scale)
    if out is None:
        return result
    for seg in segments:
        rows = slice(seg.q_start, seg.q_start + seg.q_len)
        out[rows] = result[rows]
    return out


def paged_prefill_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    meta: PrefillTensors,
    scale: float,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal GQA attention of the prefill segments' queries over the paged cache.

    q ``[T, heads, D]`` (bf16/fp16/fp32, last dim contiguous; head ``h`` reads KV head
    ``h // (heads / kv_heads)``), cache ``[2, blocks, block_size, kv_heads, D]`` of q's dtype holding
    every segment's K/V up to ``ctx_len`` (write the chunk first), ``meta`` from :func:`prefill_tensors`.
    Returns ``out`` (``[T, heads, D]``, allocated when None) with the segments' rows written; every other
    row is left as it was, unless the keys are split over programs (:func:`key_splits`, a short chunk over
    a long context on CUDA): then rows in no segment get unspecified values, so pass the prefill rows only. fp32 softmax and accumulation. Triton on CUDA, the
    torch reference elsewhere."""
    if use_kernel(q):
        return paged_prefill_attention_triton(q, cache, meta, scale, out=out)
    return paged_prefill_attention_ref(q, cache, meta, scale, out=out)
