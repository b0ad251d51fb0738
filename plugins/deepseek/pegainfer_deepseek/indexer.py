"""DeepSeek-V3.2's DSA lightning indexer, torch reference over its own paged key cache.

Per layer the indexer keeps one key per token, ``kI = LayerNorm(wk(x))`` with its first
``qk_rope_head_dim`` channels roped half-split (pairs (i, i + d/2), unlike MLA's interleaved pairs), in a
paged cache ``[blocks, block_size, index_head_dim]`` addressed by the same block table and slots as the
layer's MLA latents. Each query token t scores every cached position s it may see,

    I[t, s] = sum_h  w[t, h] * nI^-0.5 * ReLU(qI[t, h] . kI[s]) * dI^-0.5,   w = weights_proj(x) (fp32),

with ``qI = wq_b(cq)`` (cq the MLA q-LoRA output), and keeps the ``index_topk`` best; MLA attends only to
those. When a query sees at most ``index_topk`` positions it keeps them all (dense attention).

The reference implementation's Hadamard rotation (dot products unchanged) and FP8 rounding of the
scores are not applied, as in transformers.

Under tensor parallelism the indexer is replicated, weights and key cache alike: every rank scores and
selects the same positions from its replicated inputs (the layer's normed input and MLA's replicated
``cq``). Its weights are small, and splitting its heads would need an all-reduce of the ``[T, context]``
score matrix in every layer before the top-k, more traffic than the layer's own all-reduces.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from pegainfer.kernels._triton import use_kernel
from pegainfer.layers.attention import QUERY_BLOCK, AttentionMetadata, page_slots, query_block, write_rows
from pegainfer.layers.rotary_yarn import PairedRotaryEmbedding
from pegainfer.model.model_api import ForwardBatch
from pegainfer_deepseek.config import DeepseekV3Dims
from pegainfer_deepseek.fp8 import WeightReader
from pegainfer_deepseek.indexer_decode import indexer_decode_scores
from pegainfer_deepseek.params import param

#: The name of a layer's indexer key cache: ``caches[cache_key(layer, INDEXER_CACHE)]`` (MLA's is ``caches[layer]``).
INDEXER_CACHE = "indexer"

K_NORM_EPS = 1e-6


@dataclass
class IndexSelection:
    """Which cached positions each query of a batch may attend to. ``prefill[i]`` is a mask
    ``[q_len, ctx_len]`` for the batch's i-th prefill segment (True = selected; causality and sequence
    length folded in). ``decode`` (None without decode rows) lists positions, int32
    ``[num_decodes, K]`` with ``K = min(index_topk, max_decode_seq_len)``: a row longer than ``K`` tokens
    attends to exactly those ``K`` (in no particular order), a shorter one to all its tokens (its row of
    ``decode`` is then meaningless), as ``mla_decode``'s sparse rows take them."""

    prefill: list[torch.Tensor] = field(default_factory=list)
    decode: torch.Tensor | None = None


def top_k_mask(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """``visible`` restricted to the ``k`` best-scored visible positions of each row (all when fewer)."""
    scores = scores.masked_fill(~visible, float("-inf"))
    k = min(k, scores.shape[-1])
    picked = torch.zeros_like(visible).scatter_(-1, scores.topk(k, dim=-1).indices, True)
    return picked & visible


def prefill_scratch_bytes(dims: DeepseekV3Dims, context: int, dtype_bytes: int) -> int:
    """A bound on the temporaries of ``LightningIndexer``'s prefill selection for a segment of ``context``
    tokens (segments run one at a time): the context's slots, keys and their fp32 copy, and one query
    block's fp32 scores over every head (counted twice: on the CPU the next block's scores are allocated
    after the last ones are freed, but a backend whose einsum permutes them into a copy holds two), the
    weighted index and its masked copy, the causal, picked and selected masks, top-k's values and indices. The selections themselves stay alive
    through the layer: a boolean per (query, context position), counted per token by the caller."""
    cfg = dims.indexer
    assert cfg is not None
    block = query_block(context, QUERY_BLOCK)
    per_key = 2 * 8 + cfg.head_dim * (dtype_bytes + 4) + block * (2 * cfg.n_heads * 4 + 2 * 4 + 3)
    return context * per_key + block * cfg.topk * (4 + 8)


class LightningIndexer(nn.Module):
    def __init__(self, dims: DeepseekV3Dims, dtype: torch.dtype) -> None:
        super().__init__()
        assert dims.indexer is not None and dims.q_lora_rank is not None
        self.dims = dims
        cfg = dims.indexer
        self.n_heads, self.head_dim, self.topk = cfg.n_heads, cfg.head_dim, cfg.topk
        self.wq_b = param(cfg.n_heads * cfg.head_dim, dims.q_lora_rank, dtype=dtype)
        self.wk = param(cfg.head_dim, dims.hidden_size, dtype=dtype)
        self.k_norm_weight = param(cfg.head_dim, dtype=dtype)
        self.k_norm_bias = param(cfg.head_dim, dtype=dtype)
        # Kept in float32, as DeepSeek and transformers do.
        self.weights_proj = param(cfg.n_heads, dims.hidden_size, dtype=torch.float32)

    def forward(
        self,
        x: torch.Tensor,
        cq: torch.Tensor,
        batch: ForwardBatch,
        cache: torch.Tensor,
        rotary: PairedRotaryEmbedding,
    ) -> IndexSelection:
        """Write the batch's indexer keys into ``cache`` and select, per query, the keys MLA may use.

        ``x`` is the layer's normed input ``[T, H]``, ``cq`` MLA's ``q_a_layernorm`` output ``[T, rq]``;
        ``rotary`` is the half-split rope over ``qk_rope_head_dim`` channels."""
        t, dr = x.shape[0], self.dims.qk_rope_head_dim
        q = F.linear(cq, self.wq_b).view(t, self.n_heads, self.head_dim)
        k = F.layer_norm(
            F.linear(x, self.wk), (self.head_dim,), self.k_norm_weight, self.k_norm_bias, K_NORM_EPS
        )
        q_rot, k_rot = rotary(batch.positions, q[..., :dr], k[:, None, :dr])
        q = torch.cat([q_rot, q[..., dr:]], dim=-1).float()
        k = torch.cat([k_rot[:, 0], k[:, dr:]], dim=-1)
        write_rows(cache, k, batch.attn.slot_mapping)
        # Head weights with both scales folded in: I = sum_h w_h * ReLU(q_h . k).
        weights = F.linear(x.float(), self.weights_proj) * (self.n_heads**-0.5 * self.head_dim**-0.5)
        meta = batch.attn
        return IndexSelection(
            prefill=self._prefill(q, weights, cache, meta), decode=self._decode(q, weights, cache, meta)
        )

    def _prefill(
        self, q: torch.Tensor, weights: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata
    ) -> list[torch.Tensor]:
        flat, masks = cache.flatten(0, 1), []
        for seg in meta.prefills:
            positions = torch.arange(seg.ctx_len, device=q.device)
            keys = flat[page_slots(seg.block_table, positions, meta.block_size)].float()  # [L, dI]
            first = seg.ctx_len - seg.q_len
            mask = torch.empty(seg.q_len, seg.ctx_len, dtype=torch.bool, device=q.device)
            # Query blocks bound the fp32 [n, nI, L] score tensor.
            block = query_block(seg.ctx_len, QUERY_BLOCK)
            for lo in range(0, seg.q_len, block):
                n = min(block, seg.q_len - lo)
                rows = slice(seg.q_start + lo, seg.q_start + lo + n)
                # The fp32 [n, nI, L] scores, ReLU in place, live only inside this statement.
                scores = torch.einsum("qhd,ld->qhl", q[rows], keys).relu_()
                index = torch.einsum("qh,qhl->ql", weights[rows], scores)
                del scores
                causal = positions[None, :] <= positions[first + lo : first + lo + n, None]
                mask[lo : lo + n] = top_k_mask(index, causal, self.topk)
            masks.append(mask)
        return masks

    def _decode(
        self, q: torch.Tensor, weights: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor | None:
        if not meta.num_decodes:
            return None
        rows = slice(meta.num_prefill_tokens, meta.num_prefill_tokens + meta.num_decodes)
        q, weights = q[rows], weights[rows]
        scores = indexer_decode_scores if use_kernel(q) else self._decode_scores_ref
        index = scores(
            q, weights, cache, meta.decode_block_tables, meta.decode_seq_lens, meta.max_decode_seq_len
        )
        # Positions past a row's length score -inf, so a row longer than k picks only its own.
        k = min(self.topk, index.shape[1])
        return index.topk(k, dim=-1, sorted=False).indices.to(torch.int32)

    @staticmethod
    def _decode_scores_ref(
        q: torch.Tensor,
        weights: torch.Tensor,
        cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        max_seq_len: int,
    ) -> torch.Tensor:
        """The torch form of ``indexer_decode_scores``: every row's keys up to ``max_seq_len`` gathered
        in fp32, the ``[B, nI, L]`` scores materialised; ``-inf`` past each row's length."""
        positions = torch.arange(max(1, max_seq_len), device=q.device)
        keys = cache.flatten(0, 1)[page_slots(block_tables, positions, cache.shape[1])].float()
        scores = torch.relu(torch.einsum("bhd,bld->bhl", q, keys))  # [B, nI, L]
        index = torch.einsum("bh,bhl->bl", weights, scores)
        return index.masked_fill(positions[None, :] >= seq_lens[:, None], float("-inf"))

    def load(self, reader: WeightReader, prefix: str) -> None:
        p = prefix + "self_attn.indexer."
        named = [
            ("wq_b.weight", self.wq_b),
            ("wk.weight", self.wk),
            ("k_norm.weight", self.k_norm_weight),
            ("k_norm.bias", self.k_norm_bias),
            ("weights_proj.weight", self.weights_proj),
        ]
        with torch.no_grad():
            for name, target in named:
                target.copy_(reader.get(p + name, tuple(target.shape), target.dtype))
