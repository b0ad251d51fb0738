"""One DeepSeek-V4 decoder layer: attention then MoE, each wrapped in a hyper-connection over the streams."""

from __future__ import annotations

import torch
from torch import nn

from pegainfer_deepseek.hyper_connections import HyperConnection
from pegainfer_deepseek.params import param
from pegainfer_deepseek.v4_attention import V4Attention
from pegainfer_deepseek.v4_config import DeepseekV4Dims
from pegainfer_deepseek.v4_moe import V4MoE
from pegainfer_deepseek.v4_primitives import TrailingRope, scaled_rms_norm
from pegainfer_deepseek.v4_sequences import SequenceRows
from pegainfer_deepseek.v4_weights import V4Weights


class V4DecoderLayer(nn.Module):
    def __init__(self, dims: DeepseekV4Dims, layer_index: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.dims = dims
        self.layer_index = layer_index
        self.attn_hc = HyperConnection(dims)
        self.input_layernorm = param(dims.hidden_size, dtype=torch.float32)
        self.self_attn = V4Attention(dims, layer_index, dtype)
        self.ffn_hc = HyperConnection(dims)
        self.post_attention_layernorm = param(dims.hidden_size, dtype=torch.float32)
        self.mlp = V4MoE(dims, layer_index, dtype)

    def forward(
        self,
        streams: torch.Tensor,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        seqs: list[SequenceRows],
        block_size: int,
        state: dict[str, torch.Tensor],
        entry_cache: torch.Tensor | None,
        index_cache: torch.Tensor | None,
        rope: TrailingRope,
    ) -> torch.Tensor:
        """The new residual streams ``[T, n, H]``."""
        eps = self.dims.rms_norm_eps
        collapsed, post, comb = self.attn_hc(streams)
        attn = self.self_attn(
            scaled_rms_norm(collapsed, self.input_layernorm, eps),
            positions,
            seqs,
            block_size,
            state,
            entry_cache,
            index_cache,
            rope,
        )
        streams = HyperConnection.expand(streams, attn, post, comb)
        collapsed, post, comb = self.ffn_hc(streams)
        ffn = self.mlp(scaled_rms_norm(collapsed, self.post_attention_layernorm, eps), token_ids)
        return HyperConnection.expand(streams, ffn, post, comb)

    def load(self, weights: V4Weights, prefix: str) -> None:
        """``prefix`` is e.g. ``layers.3.``."""
        h = self.dims.hidden_size
        with torch.no_grad():
            self.input_layernorm.copy_(weights.get(prefix + "attn_norm.weight", (h,), torch.float32))
            self.post_attention_layernorm.copy_(weights.get(prefix + "ffn_norm.weight", (h,), torch.float32))
        self.attn_hc.load(weights, prefix + "hc_attn_")
        self.ffn_hc.load(weights, prefix + "hc_ffn_")
        self.self_attn.load(weights, prefix + "attn.")
        self.mlp.load(weights, prefix + "ffn.")
