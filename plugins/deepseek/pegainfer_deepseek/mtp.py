"""DeepSeek-V3 multi-token prediction (MTP): one extra module that drafts the token after next.

For position p the module takes the main model's final (normed) hidden state ``h_p`` and the embedding of
the token at p + 1, and predicts the token at p + 2:

    x = eh_proj([enorm(embed(t_{p+1})) | hnorm(h_p)])
    x = DecoderLayer(x)              # a full MLA + MoE layer with its own latent cache
    logits = head(shared_head.norm(x))

The order of the concatenation (embedding first) is DeepSeek's and transformers'. The checkpoint stores
the module as layer ``num_hidden_layers + k`` with its own copies of the embedding and the head.

Under tensor parallelism the decoder layer is sharded like the main ones, ``eh_proj`` and the norms are
replicated, and the module's embedding and head are vocab-parallel; the head's logits are gathered, so
every rank holds the same draft logits and takes the same argmax.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pegainfer.layers.norm import rms_norm
from pegainfer.layers.parallel import gather_logits, vocab_parallel_embed
from pegainfer.layers.rotary_yarn import PairedRotaryEmbedding
from pegainfer.model.model_api import ForwardBatch
from pegainfer.parallel.distributed import TensorParallel
from pegainfer.parallel.sharding import vocab_shard, vocab_split
from pegainfer_deepseek.config import DeepseekV3Dims
from pegainfer_deepseek.decoder import DecoderLayer
from pegainfer_deepseek.fp8 import WeightReader
from pegainfer_deepseek.params import param


class MultiTokenPredictor(nn.Module):
    def __init__(
        self, dims: DeepseekV3Dims, layer_index: int, dtype: torch.dtype, tp: TensorParallel | None = None
    ) -> None:
        super().__init__()
        self.tp = tp = tp or TensorParallel()
        h, rows = dims.hidden_size, vocab_shard(dims.vocab_size, tp.size)
        self.dims = dims
        self.layer_index = layer_index
        self.embed_tokens = param(rows, h, dtype=dtype)
        self.enorm = param(h, dtype=dtype)
        self.hnorm = param(h, dtype=dtype)
        self.eh_proj = param(h, 2 * h, dtype=dtype)
        self.block = DecoderLayer(dims, layer_index, dtype, tp)
        self.head_norm = param(h, dtype=dtype)
        self.head = param(rows, h, dtype=dtype)

    def forward(
        self,
        hidden_states: torch.Tensor,
        next_token_ids: torch.Tensor,
        batch: ForwardBatch,
        cache: torch.Tensor,
        rotary: PairedRotaryEmbedding,
        index_cache: torch.Tensor | None = None,
        index_rotary: PairedRotaryEmbedding | None = None,
    ) -> torch.Tensor:
        """The module's output hidden states ``[T, H]`` (before ``shared_head.norm``); V3.2's module selects
        its keys with its own indexer over ``index_cache``."""
        eps = self.dims.rms_norm_eps
        e = rms_norm(vocab_parallel_embed(next_token_ids, self.embed_tokens, self.tp), self.enorm, eps)
        h = rms_norm(hidden_states.to(self.eh_proj.dtype), self.hnorm, eps)
        x = F.linear(torch.cat([e, h], dim=-1), self.eh_proj)
        return self.block(x, batch, cache, rotary, index_cache, index_rotary)

    def share_tables(self, embed_tokens: nn.Parameter, lm_head: nn.Parameter) -> None:
        """Take the main model's embedding and head where the checkpoint's copies equal them on this rank
        (DeepSeek-V3 shares them with its MTP module; the release stores them twice), freeing the module's
        own: 2 x vocab / tp x hidden values a rank (0.46 GB at tp=8 for the published model)."""
        if torch.equal(self.embed_tokens, embed_tokens):
            self.embed_tokens = embed_tokens
        if torch.equal(self.head, lm_head):
            self.head = lm_head

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits ``[N, V]`` (float32), the same on every rank."""
        local = F.linear(rms_norm(hidden, self.head_norm, self.dims.rms_norm_eps), self.head)
        return gather_logits(local, self.tp, self.dims.vocab_size)

    def load(self, reader: WeightReader, prefix: str) -> None:
        dtype, table = self.eh_proj.dtype, (self.dims.vocab_size, self.dims.hidden_size)
        # (name, parameter, full shape and shard rule when vocab-parallel)
        named = [
            ("embed_tokens.weight", self.embed_tokens, table),
            ("enorm.weight", self.enorm, None),
            ("hnorm.weight", self.hnorm, None),
            ("eh_proj.weight", self.eh_proj, None),
            ("shared_head.norm.weight", self.head_norm, None),
            ("shared_head.head.weight", self.head, table),
        ]
        with torch.no_grad():
            for name, target, full in named:
                if full is None:
                    target.copy_(reader.get(prefix + name, tuple(target.shape), dtype))
                else:
                    target.copy_(reader.get(prefix + name, full, dtype, vocab_split()))
        self.block.load(reader, prefix)
