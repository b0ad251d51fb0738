"""One DeepSeek-V3 decoder layer: ``h = x + MLA(norm(x))``, then ``x = h + FFN(norm(h))``.

Under tensor parallelism the residual stream is replicated; MLA all-reduces its output projection and
the FFN (dense SwiGLU or MoE, each holding its share of the intermediate features) returns a partial
sum that is all-reduced here, once per layer; rank 0's partial includes the residual ``h``.
"""

from __future__ import annotations

import torch
from torch import nn

from pegainfer import ops
from pegainfer.layers.attention import prefill_graph_real_tokens
from pegainfer.layers.rotary_yarn import PairedRotaryEmbedding
from pegainfer.model.model_api import ForwardBatch
from pegainfer.parallel.distributed import TensorParallel
from pegainfer_deepseek.config import DeepseekV3Dims
from pegainfer_deepseek.fp8 import WeightReader
from pegainfer_deepseek.mla import MLAttention
from pegainfer_deepseek.moe import MoE, SwiGLU
from pegainfer_deepseek.params import param


class DecoderLayer(nn.Module):
    """Dense SwiGLU below ``first_k_dense_replace``, routed MoE from there on (MTP layers included)."""

    def __init__(
        self, dims: DeepseekV3Dims, layer_index: int, dtype: torch.dtype, tp: TensorParallel | None = None
    ) -> None:
        super().__init__()
        self.dims = dims
        self.layer_index = layer_index
        self.tp = tp = tp or TensorParallel()
        self.input_layernorm = param(dims.hidden_size, dtype=dtype)
        self.self_attn = MLAttention(dims, dtype, tp)
        self.post_attention_layernorm = param(dims.hidden_size, dtype=dtype)
        self.mlp: nn.Module = (
            MoE(dims, dtype, tp)
            if dims.is_moe_layer(layer_index)
            else SwiGLU(
                dims.hidden_size,
                dims.intermediate_size,
                dtype,
                tp=tp,
                fp8_block=dims.fp8_block,
                fp8_checkpoint=dims.fp8 is not None,
                fp8_activations=dims.fp8_activations,
            )  # fmt: skip
        )

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        cache: torch.Tensor,
        rotary: PairedRotaryEmbedding,
        index_cache: torch.Tensor | None = None,
        index_rotary: PairedRotaryEmbedding | None = None,
    ) -> torch.Tensor:
        """``index_cache`` / ``index_rotary``: the V3.2 indexer's key cache and half-split rope."""
        eps = self.dims.rms_norm_eps
        attn = self.self_attn(
            ops.rms_norm(x, self.input_layernorm, eps), batch, cache, rotary, index_cache, index_rotary
        )
        # attn (this layer's own tensor, unlike x) takes the residual sum in place: one launch with the norm.
        normed, h = ops.add_rms_norm(x, attn, self.post_attention_layernorm, eps)
        # Rank 0's partial carries h (added in the FFN's last GEMM), so the all-reduce sums to h + FFN.
        residual = h if self.tp.rank == 0 else None
        if isinstance(self.mlp, MoE):  # a prefill graph's padding rows route as row 0 (routing.py)
            out = self.mlp(normed, residual, real_rows=prefill_graph_real_tokens(batch.attn))
        else:
            out = self.mlp(normed, residual)
        return self.tp.all_reduce(out)

    def load(self, reader: WeightReader, prefix: str) -> None:
        h, dtype = self.dims.hidden_size, self.input_layernorm.dtype
        with torch.no_grad():
            self.input_layernorm.copy_(reader.get(prefix + "input_layernorm.weight", (h,), dtype))
            self.post_attention_layernorm.copy_(
                reader.get(prefix + "post_attention_layernorm.weight", (h,), dtype)
            )
        self.self_attn.load(reader, prefix)
        self.mlp.load(reader, prefix + "mlp.")
