"""Paged attention, torch reference: KV written into pages through a slot mapping, read through block tables.

Token layout of a batch: the prefill chunks' tokens first (one segment per request), then one token per
decode row. Decode rows read their metadata from the persistent decode buffers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PrefillSegment:
    """One request's chunk: queries ``[q_start, q_start + q_len)`` of the batch, attending to ``ctx_len``
    cached tokens (the chunk's own included) through ``block_table``."""

    q_start: int
    q_len: int
    ctx_len: int
    block_table: torch.Tensor


@dataclass
class AttentionMetadata:
    block_size: int
    slot_mapping: torch.Tensor  # [T] flat page slot of every token of the batch
    prefills: list[PrefillSegment]
    num_prefill_tokens: int
    num_decodes: int = 0
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks]
    decode_seq_lens: torch.Tensor | None = None  # [num_decodes], context length including the new token
    max_decode_seq_len: int = 0
    #: A CUDA-graph prefill step (``pegainfer.executor.prefill_graphs``): ``prefills`` are placeholders
    #: whose host values are bounds only (``q_len``: the bucket's token count, the same ``q_start`` 0), and
    #: the segments' real values are device tensors in ``derived`` ("prefill_tensors", "cu_seqlens",
    #: "segment_tables"; the latter two in the eager form of such a step too). Only models with
    #: ``CausalLM.prefill_graph_tokens`` get such steps.
    in_graph: bool = False
    #: Forms of this metadata a backend builds once per forward and every layer reuses (e.g. the packed
    #: device tensors of the prefill segments), by name.
    derived: dict[str, object] = field(default_factory=dict, repr=False, compare=False)


#: Queries per block in the reference prefill attention.
QUERY_BLOCK = 256
#: Longest context a whole block of queries attends at once (``query_block``).
BLOCK_CONTEXT = 4096


def query_block(context: int, most: int = QUERY_BLOCK) -> int:
    """Queries per block over ``context`` keys: ``most`` up to ``BLOCK_CONTEXT`` keys, proportionally fewer
    past it (16 at least), so that one block's score matrices stop growing with the context (at 163840
    keys, 16 queries a block hold the scores 256 would over 10240)."""
    return max(min(16, most), min(most, most * BLOCK_CONTEXT // max(context, 1)))


def reference_scratch_bytes(
    num_heads: int, kv_heads: int, head_dim: int, max_model_len: int, dtype_bytes: int
) -> int:
    """Worst-case scratch of one reference prefill attention call: the gathered K/V of a full context and
    the fp32 scores, masked scores and probabilities of one query block over it."""
    kv = 2 * max_model_len * kv_heads * head_dim * dtype_bytes
    return kv + 3 * 4 * num_heads * QUERY_BLOCK * max_model_len


def without_padding_slots(
    slot_mapping: torch.Tensor, *values: torch.Tensor
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """``(slots, values)`` for an ``index_copy_`` that leaves the negative slots (padding rows and tokens)
    unwritten. On the CPU their rows are dropped; on CUDA, where dropping them would sync with the host
    (this runs inside graphs: V3.2's indexer keys, every cache under ``PEGAINFER_DISABLE_TRITON``), they
    repeat the first row's write (:func:`padding_as_first_row`)."""
    if not slot_mapping.is_cuda:
        if bool((slot_mapping < 0).any()):
            keep = slot_mapping >= 0
            return slot_mapping[keep], tuple(v[keep] for v in values)
        return slot_mapping, values
    return padding_as_first_row(slot_mapping, *values)


def padding_as_first_row(
    slot_mapping: torch.Tensor, *values: torch.Tensor
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Padding rows (negative slots) rewritten to the first row's slot and values, without a host sync: a
    second identical write when the first row is real, as in every step (tokens fill from the front). A
    batch of padding only (a graph captured over placeholder inputs, before any request holds a page)
    writes its first row into slot 0."""
    pad = slot_mapping < 0
    slots = torch.where(pad, slot_mapping[:1].clamp(min=0), slot_mapping)
    shape = (-1,) + (1,) * (values[0].dim() - 1) if values else (-1,)
    return slots, tuple(torch.where(pad.view(shape), v[:1], v) for v in values)


def write_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store k, v ``[T, kv_heads, D]`` into ``cache`` ``[2, blocks, block_size, kv_heads, D]`` at the slots;
    negative slots (padding) are left unwritten (:func:`without_padding_slots`)."""
    slot_mapping, (k, v) = without_padding_slots(slot_mapping, k, v)
    flat = cache.flatten(1, 2)
    flat[0].index_copy_(0, slot_mapping, k.to(cache.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(cache.dtype))


def write_rows(cache: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store per-token ``rows`` ``[T, D]`` into a one-tensor paged cache ``[blocks, block_size, D]`` (e.g.
    MLA's latents, an indexer's keys) at the slots; negative slots (padding) are left unwritten."""
    slot_mapping, (rows,) = without_padding_slots(slot_mapping, rows)
    cache.flatten(0, 1).index_copy_(0, slot_mapping, rows.to(cache.dtype))


def page_slots(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """The cache slots (page · block_size + offset) of ``positions`` through ``block_table``."""
    return block_table[..., positions // block_size].long() * block_size + positions % block_size


def prefill_graph_real_tokens(meta: AttentionMetadata) -> torch.Tensor | None:
    """A prefill-graph step's count of real tokens (device ``[1]``; the tokens from there on are padding),
    its rows' form from :func:`prefill_graph_rows` included; None off that path, where every token is
    real."""
    cu_seqlens = meta.derived.get("cu_seqlens")
    return None if cu_seqlens is None else cu_seqlens[-1:]


def prefill_graph_rows(meta: AttentionMetadata, positions: torch.Tensor) -> AttentionMetadata:
    """A prefill-graph step's tokens as decode rows, read from the segments' device form only (``derived``'s
    "cu_seqlens" and "segment_tables"; no host sync, every shape static): token i is a row attending to the
    first ``positions[i] + 1`` tokens of its segment through that segment's block table, which is its
    causal context. A decode-form attention (MLA's absorbed form) then runs a short chunk over a long
    cached context without expanding that context. Padding tokens (in no segment, position 0) read one
    token through a padding segment's (or the last) table: their outputs are discarded. The rows keep
    "cu_seqlens" (:func:`prefill_graph_real_tokens`)."""
    cu_seqlens = meta.derived["cu_seqlens"]
    tables = meta.derived["segment_tables"]
    tokens = torch.arange(positions.shape[0], device=positions.device)
    segment = torch.searchsorted(cu_seqlens[1:], tokens, right=True).clamp_(max=tables.shape[0] - 1)
    return AttentionMetadata(
        block_size=meta.block_size,
        slot_mapping=meta.slot_mapping,
        prefills=[],
        num_prefill_tokens=0,
        num_decodes=positions.shape[0],
        decode_block_tables=tables.index_select(0, segment),
        decode_seq_lens=(positions + 1).to(torch.int32),
        max_decode_seq_len=tables.shape[1] * meta.block_size,
        derived={"cu_seqlens": cu_seqlens},
    )


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [..., kv_heads, group, n, D], k/v [..., kv_heads, L, D], mask [..., n, L] bool (True = attend)."""
    scores = torch.matmul(q, k.unsqueeze(-3).transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask.unsqueeze(-3).unsqueeze(-3), float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return torch.matmul(probs, v.unsqueeze(-3))


def paged_attention_reference(
    q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """The torch oracle of ``paged_attention``; softmax runs in fp32."""
    num_tokens, num_heads, head_dim = q.shape
    kv_heads = cache.shape[-2]
    group = num_heads // kv_heads
    k_flat, v_flat = cache[0].flatten(0, 1), cache[1].flatten(0, 1)
    out = torch.empty_like(q)
    for seg in meta.prefills:
        positions = torch.arange(seg.ctx_len, device=q.device)
        idx = page_slots(seg.block_table, positions, meta.block_size)
        k = k_flat[idx].transpose(0, 1)  # [kv_heads, L, D]
        v = v_flat[idx].transpose(0, 1)
        first = seg.ctx_len - seg.q_len
        # Query blocks bound the fp32 score matrix to QUERY_BLOCK x context (see reference_scratch_bytes).
        for lo in range(0, seg.q_len, QUERY_BLOCK):
            n = min(QUERY_BLOCK, seg.q_len - lo)
            rows = slice(seg.q_start + lo, seg.q_start + lo + n)
            qs = q[rows].view(n, kv_heads, group, head_dim)
            mask = positions[None, :] <= positions[first + lo : first + lo + n, None]
            o = _attend(qs.permute(1, 2, 0, 3), k, v, mask, scale)  # [kv_heads, group, n, D]
            out[rows] = o.permute(2, 0, 1, 3).reshape(n, num_heads, head_dim)
    if meta.num_decodes:
        start, b = meta.num_prefill_tokens, meta.num_decodes
        positions = torch.arange(meta.max_decode_seq_len, device=q.device)
        idx = page_slots(meta.decode_block_tables, positions, meta.block_size)  # [B, L]
        k = k_flat[idx].permute(0, 2, 1, 3)  # [B, kv_heads, L, D]
        v = v_flat[idx].permute(0, 2, 1, 3)
        mask = (positions[None, :] < meta.decode_seq_lens[:, None])[:, None, :]  # [B, 1, L]
        qd = q[start : start + b].view(b, kv_heads, group, 1, head_dim)
        o = _attend(qd, k, v, mask, scale)  # [B, kv_heads, group, 1, D]
        out[start : start + b] = o.reshape(b, num_heads, head_dim)
    return out
