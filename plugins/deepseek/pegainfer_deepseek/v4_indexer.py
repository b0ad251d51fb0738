"""The lightning indexer of DeepSeek-V4's compressed sparse attention (CSA) layers.

It keeps its own compressed keys (a CSA-style ``Compressor`` at ``index_head_dim``, in its own paged
cache) and scores every compressed entry a query may see,

    I[t, w] = Σ_h  weights_proj(x_t)_h · nI^-0.5 · ReLU(q_{t,h} · K_w) · dI^-0.5,   q = q_b_proj(cq),

with the queries roped by the compress rope at their positions. Entry w is visible to position t when its
window has closed, ``w < (t + 1) // ratio``; attention uses only the ``index_topk`` best visible entries
(all of them when there are fewer).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pegainfer.layers.attention import QUERY_BLOCK
from pegainfer_deepseek.indexer import top_k_mask
from pegainfer_deepseek.params import param
from pegainfer_deepseek.v4_compressor import Compressor
from pegainfer_deepseek.v4_config import CSA, DeepseekV4Dims
from pegainfer_deepseek.v4_primitives import TrailingRope
from pegainfer_deepseek.v4_sequences import SequenceRows, entry_slots
from pegainfer_deepseek.v4_weights import V4Weights


class CompressedIndexer(nn.Module):
    def __init__(self, dims: DeepseekV4Dims, dtype: torch.dtype) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.topk = dims.index_n_heads, dims.index_head_dim, dims.index_topk
        self.ratio = dims.compress_rates[CSA]
        self.compressor = Compressor(
            dims.hidden_size, self.head_dim, self.ratio, overlapping=True, eps=dims.rms_norm_eps, dtype=dtype
        )
        self.q_b_proj = param(self.n_heads * self.head_dim, dims.q_lora_rank, dtype=dtype)
        self.weights_proj = param(self.n_heads, dims.hidden_size, dtype=dtype)

    def forward(
        self,
        x: torch.Tensor,
        cq: torch.Tensor,
        positions: torch.Tensor,
        seqs: list[SequenceRows],
        ring: torch.Tensor,
        cache: torch.Tensor,
        block_size: int,
        rope: TrailingRope,
    ) -> list[torch.Tensor]:
        """Per sequence, the entries each of its queries attends to: bool ``[length, entries]``, where
        ``entries = end_position // ratio`` (every entry closed so far)."""
        self.compressor(x, seqs, ring, cache, block_size, rope)
        q = F.linear(cq, self.q_b_proj).view(-1, self.n_heads, self.head_dim)
        q = rope(q, positions).float()
        head_weights = F.linear(x, self.weights_proj).float() * self.n_heads**-0.5
        flat = cache.flatten(0, 1)
        selections = []
        for seq in seqs:
            count = seq.end_position // self.ratio
            entries = torch.arange(count, device=x.device)
            keys = flat[entry_slots(seq.block_table, entries, self.ratio, block_size, cache.shape[1])].float()
            mask = torch.empty(seq.length, count, dtype=torch.bool, device=x.device)
            # Query blocks bound the float32 [n, nI, entries] score tensor.
            for lo in range(0, seq.length, QUERY_BLOCK):
                rows = slice(seq.start + lo, seq.start + min(lo + QUERY_BLOCK, seq.length))
                scores = torch.relu(torch.einsum("qhd,ed->qhe", q[rows], keys)) * self.head_dim**-0.5
                index = (scores * head_weights[rows, :, None]).sum(dim=1)
                visible = entries[None, :] < (positions[rows, None] + 1) // self.ratio
                mask[lo : lo + index.shape[0]] = top_k_mask(index, visible, self.topk)
            selections.append(mask)
        return selections

    def load(self, weights: V4Weights, prefix: str) -> None:
        """``prefix`` is e.g. ``layers.3.attn.indexer.``."""
        self.compressor.load(weights, prefix + "compressor.")
        with torch.no_grad():
            for name, target in (("wq_b.weight", self.q_b_proj), ("weights_proj.weight", self.weights_proj)):
                target.copy_(weights.get(prefix + name, tuple(target.shape), target.dtype))
