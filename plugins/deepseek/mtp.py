"""DeepSeek-V3 multi-token prediction (MTP): one extra module that drafts the token after next.

For position p the module takes the main model's final (normed) hidden state ``h_p`` and the embedding of
the token at p + 1, and predicts the token at p + 2:

    x = eh_proj([enorm(embed(t_{p+1})) | hnorm(h_p)])
    x = DecoderLayer(x)              # a full MLA + MoE layer with its own latent cache
    logits = head(shared_head.norm(x))

The order of the concatenation (embedding first) is DeepSeek's and transformers'. The checkpoint stores
the module as layer ``num_hidden_layers + k`` with its own copies of the embedding and the head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pegainfer.layers.norm import rms_norm
from pegainfer.layers.rotary_yarn import PairedRotaryEmbedding
from pegainfer.model_api import ForwardBatch
from pegainfer_deepseek.config import DeepseekV3Dims
from pegainfer_deepseek.decoder import DecoderLayer
from pegainfer_deepseek.fp8 import WeightReader
from pegainfer_deepseek.params import param


class MultiTokenPredictor(nn.Module):
    def __init__(self, dims: DeepseekV3Dims, layer_index: int, dtype: torch.dtype) -> None:
        super().__init__()
        h, v = dims.hidden_size, dims.vocab_size
        self.dims = dims
        self.layer_index = layer_index
        self.embed_tokens = param(v, h, dtype=dtype)
        self.enorm = param(h, dtype=dtype)
        self.hnorm = param(h, dtype=dtype)
        self.eh_proj = param(h, 2 * h, dtype=dtype)
        self.block = DecoderLayer(dims, layer_index, dtype)
        self.head_norm = param(h, dtype=dtype)
        self.head = param(v, h, dtype=dtype)

    def forward(
        self,
        hidden_states: torch.Tensor,
        next_token_ids: torch.Tensor,
        batch: ForwardBatch,
        cache: torch.Tensor,
        rotary: PairedRotaryEmbedding,
    ) -> torch.Tensor:
        """The module's output hidden states ``[T, H]`` (before ``shared_head.norm``)."""
        eps = self.dims.rms_norm_eps
        e = rms_norm(F.embedding(next_token_ids, self.embed_tokens), self.enorm, eps)
        h = rms_norm(hidden_states.to(self.eh_proj.dtype), self.hnorm, eps)
        x = F.linear(torch.cat([e, h], dim=-1), self.eh_proj)
        return self.block(x, batch, cache, rotary)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(rms_norm(hidden, self.head_norm, self.dims.rms_norm_eps), self.head).float()

    def load(self, reader: WeightReader, prefix: str) -> None:
        dtype = self.eh_proj.dtype
        named = [
            ("embed_tokens.weight", self.embed_tokens),
            ("enorm.weight", self.enorm),
            ("hnorm.weight", self.hnorm),
            ("eh_proj.weight", self.eh_proj),
            ("shared_head.norm.weight", self.head_norm),
            ("shared_head.head.weight", self.head),
        ]
        with torch.no_grad():
            for name, target in named:
                target.copy_(reader.get(prefix + name, tuple(target.shape), dtype))
        self.block.load(reader, prefix)
