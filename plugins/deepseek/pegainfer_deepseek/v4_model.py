"""DeepSeek-V4 (``DeepseekV4ForCausalLM``), torch reference path.

A residual of ``hc_mult`` hyper-connected streams (``hyper_connections.py``); attention with one shared
KV head over a sliding window, plus compressed entries on CSA/HCA layers (``v4_attention.py``,
``v4_compressor.py``, ``v4_indexer.py``); an MoE in every layer, hash-routed in the first ones
(``v4_moe.py``).

Buffers, per layer (see docs/architecture.md, "DeepSeek-V4 state"):

* ``states[layer]`` (``RecurrentStateSpec``, one slot per request): the sliding window's keys, a ring of
  ``sliding_window`` rows, and the compressors' carry-over rings;
* ``caches[layer]`` (``PagedCompressedSpec``, CSA/HCA layers): the compressed KV entries;
* ``caches[(layer, "indexer")]`` (``PagedCompressedSpec``, CSA layers): the indexer's keys.

The MTP layers of the release checkpoints are not served: transformers does not implement them, so there
is no reference to check a drafting path against. The model does not embed on the device (like V3, the
reference path is not graph-captured).

Tensor parallelism is refused (``from_hf_config`` raises a ConfigError at tp > 1): the grouped output
projection, the hyper-connection streams, the compressors and the hash-routed MoE are not sharded yet.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pegainfer.config.schema import ModelConfig
from pegainfer.errors import ConfigError, ExecutorError
from pegainfer.layers.attention import QUERY_BLOCK
from pegainfer.memory.buffer_specs import (
    BufferSpec,
    CacheKey,
    PagedCompressedSpec,
    RecurrentStateSpec,
    TransientSpec,
    cache_key,
    dtype_size,
)
from pegainfer.model.checkpoint import CheckpointReader
from pegainfer.model.model_api import CausalLM, ForwardBatch
from pegainfer.parallel.distributed import TensorParallel
from pegainfer_deepseek.fp8 import WeightReader
from pegainfer_deepseek.hyper_connections import HyperHead
from pegainfer_deepseek.indexer import INDEXER_CACHE
from pegainfer_deepseek.params import param
from pegainfer_deepseek.v4_config import CSA, SLIDING, DeepseekV4Dims
from pegainfer_deepseek.v4_decoder import V4DecoderLayer
from pegainfer_deepseek.v4_primitives import TrailingRope, scaled_rms_norm
from pegainfer_deepseek.v4_sequences import sequences
from pegainfer_deepseek.v4_weights import V4Weights

logger = logging.getLogger(__name__)


class DeepseekV4ForCausalLM(CausalLM):
    embeds_on_device = False
    decode_graphs = False  # the reference path walks the batch per sequence on the host (v4_sequences)
    prefix_caching_refusal = (
        "a compressed entry is written into the page of its window's first token when the window closes, "
        "up to ratio - 1 tokens later, so a full page is not final (a request resuming inside a window "
        "would write into a shared page), and the sliding-window and compressor rings would need "
        "snapshots of their own"
    )

    def __init__(self, dims: DeepseekV4Dims, *, dtype: torch.dtype, max_model_len: int) -> None:
        super().__init__()
        self.dims = dims
        self.dtype = dtype
        self.max_model_len = max_model_len
        h, v = dims.hidden_size, dims.vocab_size
        self.embed_tokens = param(v, h, dtype=dtype)
        self.layers = nn.ModuleList(V4DecoderLayer(dims, i, dtype) for i in range(dims.num_layers))
        self.hc_head = HyperHead(dims)
        self.norm = param(h, dtype=torch.float32)
        self.lm_head = None if dims.tie_word_embeddings else param(v, h, dtype=dtype)
        self.main_rope = TrailingRope(dims.main_rope, dims.rope_dim)
        self.compress_rope = TrailingRope(dims.compress_rope, dims.rope_dim)

    @classmethod
    def from_hf_config(
        cls,
        hf_config: dict[str, Any],
        model_config: ModelConfig,
        *,
        dtype: torch.dtype,
        max_model_len: int,
        tp: TensorParallel | None = None,
    ) -> DeepseekV4ForCausalLM:
        """``tp`` is accepted so that tensor parallelism is refused here, with V4's own reason."""
        if tp is not None and tp.size > 1:
            raise ConfigError(
                f"DeepSeek-V4 does not support tensor parallelism yet (tensor_parallel_size={tp.size}): "
                "its grouped output projection, hyper-connection streams, compressors and hash-routed "
                "MoE are not sharded; run it with tensor_parallel_size=1"
            )
        dims = DeepseekV4Dims.from_hf_config(hf_config)
        if int(hf_config.get("num_nextn_predict_layers") or 0):
            logger.info("DeepSeek-V4: the MTP layers are not served (transformers has no reference for them)")
        return cls(dims, dtype=dtype, max_model_len=max_model_len)

    @staticmethod
    def max_context_length(hf_config: dict[str, Any]) -> int:
        return int(hf_config.get("max_position_embeddings", 1048576))

    @property
    def vocab_size(self) -> int:
        return self.dims.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.dims.hidden_size

    def load_weights(self, reader: CheckpointReader) -> None:
        dims = self.dims
        weights = V4Weights(WeightReader(reader, dims.fp8.block if dims.fp8 else None))
        shape = (dims.vocab_size, dims.hidden_size)
        with torch.no_grad():
            self.embed_tokens.copy_(weights.get("embed.weight", shape, self.dtype))
            self.norm.copy_(weights.get("norm.weight", (dims.hidden_size,), torch.float32))
            if self.lm_head is not None:
                self.lm_head.copy_(weights.get("head.weight", shape, self.dtype))
        self.hc_head.load(weights)
        for layer in self.layers:
            layer.load(weights, f"layers.{layer.layer_index}.")

    def buffer_specs(self) -> list[BufferSpec]:
        """Per layer a state slot (window and compressor rings); per CSA/HCA layer a paged cache of
        compressed entries, per CSA layer another of indexer keys (named ``INDEXER_CACHE``)."""
        dims, specs = self.dims, []
        for layer in self.layers:
            i = layer.layer_index
            specs.append(RecurrentStateSpec(i, tuple(layer.self_attn.state_shapes()), self.dtype))
            kind = dims.layer_kinds[i]
            if kind != SLIDING:
                specs.append(PagedCompressedSpec(i, dims.head_dim, dims.ratio(i), self.dtype))
            if kind == CSA:
                specs.append(
                    PagedCompressedSpec(i, dims.index_head_dim, dims.ratio(i), self.dtype, INDEXER_CACHE)
                )
        return specs

    def transient_specs(self) -> list[TransientSpec]:
        """Activations per scheduled token (streams, projections, compressor and MoE intermediates), in
        the compute dtype, float32 mixes counted twice; and the reference attention's scratch."""
        d = self.dims
        widths = (
            4 * d.hc_mult * d.hidden_size
            + 2 * (2 + d.hc_mult) * d.hc_mult
            + 2 * d.q_lora_rank
            + 3 * d.num_heads * d.head_dim
            + 2 * d.head_dim
            + 4 * 2 * d.head_dim
            + d.o_groups * d.o_lora_rank
            + d.index_n_heads * (2 * d.index_head_dim + 2)
            + 4 * 2 * d.index_head_dim
            + 6 * d.moe_intermediate_size
            + 2 * d.n_routed_experts
        )
        return [
            TransientSpec("deepseek_v4_activations", bytes_per_token=widths * dtype_size(self.dtype)),
            TransientSpec("deepseek_v4_attention_scratch", bytes_fixed=self._scratch_bytes()),
        ]

    def _scratch_bytes(self) -> int:
        """One query block of the reference attention and indexer at full context: float32 scores,
        masked scores and probabilities over window keys and every compressed entry, and the indexer's
        per-head scores with its float32 keys."""
        d, block = self.dims, QUERY_BLOCK
        ratios = [d.ratio(i) for i in range(d.num_layers) if d.layer_kinds[i] != SLIDING]
        entries = self.max_model_len // min(ratios) if ratios else 0
        keys = block + d.sliding_window + entries
        attention = 3 * 4 * d.num_heads * block * keys + keys * d.head_dim * dtype_size(self.dtype)
        indexed = self.max_model_len // d.compress_rates[CSA] if CSA in d.layer_kinds else 0
        indexer = 4 * indexed * (2 * d.index_n_heads * block + d.index_head_dim)
        return attention + indexer

    def forward(
        self,
        batch: ForwardBatch,
        caches: dict[CacheKey, torch.Tensor],
        states: dict[int, dict[str, torch.Tensor]],
    ) -> torch.Tensor:
        if batch.hidden_states is None:
            raise ExecutorError(
                "DeepseekV4ForCausalLM does not embed on the device: the batch must carry hidden_states "
                "(the engine fills them through embed())"
            )
        x = batch.hidden_states.to(self.dtype)
        streams = x.unsqueeze(1).expand(-1, self.dims.hc_mult, -1).contiguous()
        seqs = sequences(batch)
        block_size = batch.attn.block_size
        for layer in self.layers:
            i = layer.layer_index
            rope = self.main_rope if self.dims.layer_kinds[i] == SLIDING else self.compress_rope
            streams = layer(
                streams,
                batch.token_ids,
                batch.positions,
                seqs,
                block_size,
                states[i],
                caches.get(i),
                caches.get(cache_key(i, INDEXER_CACHE)),
                rope,
            )
        return scaled_rms_norm(self.hc_head(streams), self.norm, self.dims.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens if self.lm_head is None else self.lm_head
        return F.linear(hidden, weight).float()

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self.embed_tokens)
