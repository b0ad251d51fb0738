"""DeepSeek-V4 attention, torch reference: one shared KV head over a sliding window plus compressed entries.

* Queries: ``cq = q_a_norm(q_a_proj(x))``, ``q = unit_norm(q_b_proj(cq))`` per head; key = value =
  ``kv_norm(kv_proj(x))`` (one head). Both are roped on their last ``rope_dim`` channels: sliding layers
  use the main rope, CSA/HCA layers the compress rope.
* A query at position t sees the keys of positions ``(t - W, t]`` (the sliding window) and, on compressed
  layers, the entries whose window has closed (``w < (t+1) // ratio``; CSA: only those its indexer picks).
* The softmax has one learnable sink logit per head, dropped afterwards. The output's rope channels are
  rotated back at the query position (values carried the keys' rope).
* Grouped output projection: the heads split into ``o_groups`` groups, each projected by its own block of
  ``o_a_proj`` to ``o_lora_rank``, then ``o_b_proj`` mixes all groups.

The window's keys live in the request's state slot, a ring ``[W, D]`` indexed by ``position mod W``
(written after the layer read it, so a chunk sees the ring as the previous chunk left it); compressed
entries live in pages (``PagedCompressedSpec``), see ``v4_compressor``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pegainfer.layers.attention import QUERY_BLOCK
from pegainfer_deepseek.params import param
from pegainfer_deepseek.v4_compressor import Compressor
from pegainfer_deepseek.v4_config import CSA, SLIDING, DeepseekV4Dims
from pegainfer_deepseek.v4_indexer import CompressedIndexer
from pegainfer_deepseek.v4_primitives import TrailingRope, scaled_rms_norm, unit_rms_norm
from pegainfer_deepseek.v4_sequences import SequenceRows, entry_slots
from pegainfer_deepseek.v4_weights import V4Weights


class V4Attention(nn.Module):
    def __init__(self, dims: DeepseekV4Dims, layer_index: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.dims = dims
        self.kind = dims.layer_kinds[layer_index]
        self.ratio = dims.ratio(layer_index)
        h, nh, d, g = dims.hidden_size, dims.num_heads, dims.head_dim, dims.o_groups
        self.q_a_proj = param(dims.q_lora_rank, h, dtype=dtype)
        self.q_a_norm = param(dims.q_lora_rank, dtype=torch.float32)
        self.q_b_proj = param(nh * d, dims.q_lora_rank, dtype=dtype)
        self.kv_proj = param(d, h, dtype=dtype)
        self.kv_norm = param(d, dtype=torch.float32)
        self.o_a_proj = param(g * dims.o_lora_rank, nh * d // g, dtype=dtype)
        self.o_b_proj = param(h, g * dims.o_lora_rank, dtype=dtype)
        self.sinks = param(nh, dtype=torch.float32)
        self.compressor = (
            None
            if self.kind == SLIDING
            else Compressor(
                h, d, self.ratio, overlapping=self.kind == CSA, eps=dims.rms_norm_eps, dtype=dtype
            )
        )
        self.indexer = CompressedIndexer(dims, dtype) if self.kind == CSA else None

    def state_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """Per-request state: the window ring and the compressors' carry-over rings."""
        shapes = [("window", (self.dims.sliding_window, self.dims.head_dim))]
        if self.compressor is not None:
            shapes.append(("compressor", self.compressor.ring_shape))
        if self.indexer is not None:
            shapes.append(("indexer", self.indexer.compressor.ring_shape))
        return shapes

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        seqs: list[SequenceRows],
        block_size: int,
        state: dict[str, torch.Tensor],
        entry_cache: torch.Tensor | None,
        index_cache: torch.Tensor | None,
        rope: TrailingRope,
    ) -> torch.Tensor:
        """Attention output ``[T, H]`` for the normed input ``x``; updates the state and the caches."""
        dims, eps = self.dims, self.dims.rms_norm_eps
        cq = scaled_rms_norm(F.linear(x, self.q_a_proj), self.q_a_norm, eps)
        q = unit_rms_norm(F.linear(cq, self.q_b_proj).view(-1, dims.num_heads, dims.head_dim), eps)
        q = rope(q, positions)
        kv = rope(scaled_rms_norm(F.linear(x, self.kv_proj), self.kv_norm, eps), positions)
        selections = None
        if self.compressor is not None:
            assert entry_cache is not None
            self.compressor(x, seqs, state["compressor"], entry_cache, block_size, rope)
        if self.indexer is not None:
            assert index_cache is not None
            selections = self.indexer(x, cq, positions, seqs, state["indexer"], index_cache, block_size, rope)
        out = torch.empty_like(q)
        for i, seq in enumerate(seqs):
            selected = None if selections is None else selections[i]
            out[seq.rows] = self._attend(
                q[seq.rows], kv[seq.rows], seq, state["window"], entry_cache, block_size, selected
            )
        out = rope(out, positions, inverse=True)
        grouped = out.view(-1, dims.o_groups, dims.num_heads * dims.head_dim // dims.o_groups)
        o_a = self.o_a_proj.view(dims.o_groups, dims.o_lora_rank, -1)
        return F.linear(torch.einsum("tgi,goi->tgo", grouped, o_a).flatten(1), self.o_b_proj)

    def _attend(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        seq: SequenceRows,
        window_pool: torch.Tensor,
        entry_cache: torch.Tensor | None,
        block_size: int,
        selected: torch.Tensor | None,
    ) -> torch.Tensor:
        """Outputs ``[n, heads, D]`` of one sequence's queries, a query block at a time (a block reads only
        the window keys it can see); then stores the sequence's newest keys in the ring."""
        w = self.dims.sliding_window
        p0, p1 = seq.first_position, seq.end_position
        ring = window_pool[seq.slot]
        first_key = max(0, p0 - w + 1)
        window = torch.cat([ring[torch.arange(first_key, p0, device=q.device) % w], kv], dim=0)
        entries = entry_ids = None
        if self.compressor is not None:
            assert entry_cache is not None
            entry_ids = torch.arange(p1 // self.ratio, device=q.device)
            slots = entry_slots(seq.block_table, entry_ids, self.ratio, block_size, entry_cache.shape[1])
            entries = entry_cache.flatten(0, 1)[slots]
        out = torch.empty_like(q)
        for lo in range(0, seq.length, QUERY_BLOCK):
            hi = min(lo + QUERY_BLOCK, seq.length)
            q_positions = torch.arange(p0 + lo, p0 + hi, device=q.device)
            keys_from = max(first_key, p0 + lo - w + 1)
            keys = window[keys_from - first_key : p0 + hi - first_key]
            distance = q_positions[:, None] - torch.arange(keys_from, p0 + hi, device=q.device)[None, :]
            allowed = (distance >= 0) & (distance < w)
            if entries is not None:
                visible = entry_ids[None, :] < (q_positions[:, None] + 1) // self.ratio
                if selected is not None:
                    visible = visible & selected[lo:hi]
                keys = torch.cat([keys, entries], dim=0)
                allowed = torch.cat([allowed, visible], dim=1)
            out[lo:hi] = self._attend_block(q[lo:hi], keys, allowed)
        keep = min(seq.length, w)
        ring[torch.arange(p1 - keep, p1, device=q.device) % w] = kv[-keep:].to(ring.dtype)
        return out

    def _attend_block(self, q: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """Softmax attention of ``q [n, heads, D]`` over ``keys [L, D]`` (also the values) where
        ``allowed [n, L]``, with each head's sink logit in the softmax and dropped from the output."""
        scores = torch.einsum("qhd,kd->hqk", q, keys) * self.dims.head_dim**-0.5
        scores = scores.float().masked_fill(~allowed, float("-inf"))
        logits = torch.cat([scores, self.sinks[:, None, None].expand(-1, q.shape[0], 1)], dim=-1)
        probs = torch.softmax(logits - logits.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
        return torch.einsum("hqk,kd->qhd", probs.to(keys.dtype), keys)

    def load(self, weights: V4Weights, prefix: str) -> None:
        """``prefix`` is e.g. ``layers.3.attn.``."""
        named = [
            ("wq_a.weight", self.q_a_proj),
            ("q_norm.weight", self.q_a_norm),
            ("wq_b.weight", self.q_b_proj),
            ("wkv.weight", self.kv_proj),
            ("norm.weight", self.kv_norm),
            ("wo_a.weight", self.o_a_proj),
            ("wo_b.weight", self.o_b_proj),
            ("attn_sink", self.sinks),
        ]
        with torch.no_grad():
            for name, target in named:
                target.copy_(weights.get(prefix + name, tuple(target.shape), target.dtype))
        if self.compressor is not None:
            self.compressor.load(weights, prefix + "compressor.")
        if self.indexer is not None:
            self.indexer.load(weights, prefix + "indexer.")
