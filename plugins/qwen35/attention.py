"""Qwen3.5's gated full attention (the ``full_attention`` layers), over the paged KV cache.

``q_proj`` yields, per head, the query (first head_dim channels) and an output gate (next head_dim):
not two halves of the whole projection. q and k get zero-centred ``(1 + w)`` RMSNorms per head, then
partial half-split rotary on their first ``rotary_dim`` channels; causal GQA with scale head_dim^-0.5;
the output is multiplied by ``sigmoid(gate)`` before ``o_proj``.
"""

from __future__ import annotations

import torch
from torch import nn

from pegainfer.buffer_specs import PagedKVSpec
from pegainfer.layers.attention import paged_attention, write_kv
from pegainfer.layers.rotary import RotaryEmbedding
from pegainfer.loader import CheckpointReader
from pegainfer.model_api import ForwardBatch
from pegainfer_qwen35.config import Qwen35Config
from pegainfer_qwen35.norms import rms_norm_zero_centred
from pegainfer_qwen35.pass_buffers import PassBuffers


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class GatedAttention(nn.Module):
    def __init__(self, config: Qwen35Config, layer_index: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.layer_index = layer_index
        d = config.head_dim
        self.q_size, self.kv_size = config.num_heads * d, config.num_kv_heads * d
        self.qkv_proj = _param(2 * self.q_size + 2 * self.kv_size, config.hidden_size, dtype=dtype)
        self.q_norm = _param(d, dtype=dtype)
        self.k_norm = _param(d, dtype=dtype)
        self.o_proj = _param(config.hidden_size, self.q_size, dtype=dtype)
        self.scale = d**-0.5

    def cache_spec(self) -> PagedKVSpec:
        return PagedKVSpec(
            self.layer_index, self.config.num_kv_heads, self.config.head_dim, self.qkv_proj.dtype
        )

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        cache: torch.Tensor,
        rotary: RotaryEmbedding,
        bufs: PassBuffers,
    ) -> torch.Tensor:
        """Mixer output of the normed rows ``x`` ``[T, H]`` into ``bufs.mixer_out``; writes K/V pages."""
        c, t = self.config, x.shape[0]
        nq, nkv, d, eps = c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps
        qkv = torch.matmul(x, self.qkv_proj.t(), out=bufs.attn_qkv)
        query_gate, k, v = qkv.split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        query, gate = query_gate.view(t, nq, 2 * d).split(d, dim=-1)
        q = rms_norm_zero_centred(query, self.q_norm, eps)
        k = rms_norm_zero_centred(k.view(t, nkv, d), self.k_norm, eps)
        q, k = rotary(batch.positions, q, k)
        q = bufs.attn_q.view(t, nq, d).copy_(q)
        k = bufs.attn_k.view(t, nkv, d).copy_(k)
        write_kv(cache, k, v.view(t, nkv, d), batch.attn.slot_mapping)
        o = paged_attention(q, cache, batch.attn, self.scale)
        gated = torch.mul(
            o.view(t, self.q_size), torch.sigmoid(gate).reshape(t, self.q_size), out=bufs.attn_out
        )
        return torch.matmul(gated, self.o_proj.t(), out=bufs.mixer_out)

    def load(self, reader: CheckpointReader, prefix: str) -> None:
        h, d, dtype = self.config.hidden_size, self.config.head_dim, self.qkv_proj.dtype

        def get(name: str, *shape: int) -> torch.Tensor:
            return reader.get(prefix + name, shape, dtype)

        with torch.no_grad():
            self.qkv_proj.copy_(
                torch.cat(
                    [
                        get("q_proj.weight", 2 * self.q_size, h),
                        get("k_proj.weight", self.kv_size, h),
                        get("v_proj.weight", self.kv_size, h),
                    ]
                )
            )
            self.q_norm.copy_(get("q_norm.weight", d))
            self.k_norm.copy_(get("k_norm.weight", d))
            self.o_proj.copy_(get("o_proj.weight", h, self.q_size))
