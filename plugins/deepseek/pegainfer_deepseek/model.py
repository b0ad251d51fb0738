"""DeepSeek-V3 / R1 (``DeepseekV3ForCausalLM``): MLA attention over a compressed latent cache, dense first
layers then group-routed MoE layers with shared experts, YaRN rope, an optional MTP draft module, and
block-FP8 checkpoints (dequantized at load on the reference path).

DeepSeek-V3.2 (``DeepseekV32ForCausalLM``) is the same model with a DSA lightning indexer in every layer
(``indexer.py``): a second paged cache per layer, named ``indexer`` (``caches[(layer, "indexer")]``), holds its keys.
Its MTP layer is not served (drafting would need the MTP layer's indexer cache too).

DeepSeek-V3 embeds its tokens inside ``forward`` (``embeds_on_device``); V3.2 is handed its embeddings
(``batch.hidden_states``, made by the runner through ``embed``). Both decode on the engine's decode-graph
path: on CUDA the whole step, the embedding lookup included, is one CUDA graph per batch bucket (the MLA
decode, fused MoE and indexer kernels are graph-safe). In a graph V3.2's indexer scores and ranks up to the
graph's static bound (``max_model_len``), every position past a row's length at ``-inf``: its ``topk``
costs grow with ``max_model_len``, not with the context (measured in docs/benchmarks.md), where eager
decode paid the host's launches of every layer instead. V3 runs short prefill steps (MTP verification
chunks, the MTP module's passes, prompt tails after prefix hits) as CUDA graphs too, every token an
absorbed-form decode row over its own causal context (``decode_form``).

Tensor parallelism (``tp``): each rank holds its heads of MLA (``mla.py``), its share of every SwiGLU's
and expert's intermediate features (``moe.py``) and its rows of the vocab-parallel embedding and
lm_head (the MTP module's too); the router, the latent down projections, the norms and V3.2's indexer
are replicated. Two all-reduces a layer (attention output, FFN output), one for the embedding
(``embed`` runs on every rank: the ids are there anyway, hidden states would cost far more to ship) and
a gather of the logits. The latent cache is the whole latent on every rank, so the cache specs do not
depend on ``tp``; the activation estimate counts the rank's own heads and features.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from torch import nn

from pegainfer import ops
from pegainfer.config.schema import ModelConfig
from pegainfer.errors import ExecutorError
from pegainfer.layers.attention import prefill_graph_rows
from pegainfer.layers.block_fp8 import widened_bytes
from pegainfer.layers.parallel import gather_logits, vocab_parallel_embed
from pegainfer.layers.rotary_yarn import PairedRotaryEmbedding, default_inv_freq, yarn_inv_freq
from pegainfer.memory.buffer_specs import (
    BufferSpec,
    CacheKey,
    PagedLatentSpec,
    TransientSpec,
    cache_key,
    dtype_size,
)
from pegainfer.model.checkpoint import CheckpointReader
from pegainfer.model.model_api import CausalLM, ForwardBatch
from pegainfer.parallel.distributed import TensorParallel
from pegainfer.parallel.sharding import vocab_shard, vocab_split
from pegainfer_deepseek import indexer, mla
from pegainfer_deepseek.config import DeepseekV3Dims
from pegainfer_deepseek.decoder import DecoderLayer
from pegainfer_deepseek.fp8 import WeightReader
from pegainfer_deepseek.indexer import INDEXER_CACHE
from pegainfer_deepseek.mtp import MultiTokenPredictor
from pegainfer_deepseek.params import param

logger = logging.getLogger(__name__)

#: The most tokens of a prefill step run as a CUDA graph (``CausalLM.prefill_graph_tokens``): MTP
#: verification chunks (1 + k tokens a request) and prompt tails after prefix hits. Such a step runs every
#: token as an absorbed-form row over its whole context (``prefill_graph_rows``), where the eager form
#: expands each segment's context once: per 128 heads and context token the absorbed form costs about
#: 2·1088 flops a query token on the compute-bound MLA kernel (~166 TFLOP/s, docs/benchmarks.md), the
#: expanded one 2·512·256 flops once plus 2·320 a query token at GEMM rates (~600 TFLOP/s): even near 36
#: tokens a segment at long contexts (an estimate, not measured), and a graph also saves the eager step's
#: launches. 64 covers batch 16 at k = 3. V3.2's rows also rank their indexer scores over the graph's
#: static width (``max_model_len`` positions), as its decode rows do (62 us a layer for 32 decode rows at
#: 4096 positions, 179 at 163840), where the eager prefill ranks only the real context: not measured on
#: this path.
PREFILL_GRAPH_TOKENS = 64


def decode_form(batch: ForwardBatch) -> ForwardBatch:
    """``batch`` as decode rows if it is a prefill-graph step (graph or its eager form): MLA and the MoE
    then read no host value of its segments. Other batches come back as they are."""
    if "segment_tables" not in batch.attn.derived:
        return batch
    return dataclasses.replace(batch, attn=prefill_graph_rows(batch.attn, batch.positions))


def build_rotary(
    dims: DeepseekV3Dims, max_positions: int, *, interleaved: bool | None = None
) -> PairedRotaryEmbedding:
    """MLA's rope over ``qk_rope_head_dim`` channels, in the checkpoint's pairing unless ``interleaved``
    says otherwise (V3.2's indexer uses the same frequencies half-split)."""
    rope, dim = dims.rope, dims.qk_rope_head_dim
    paired = rope.interleaved if interleaved is None else interleaved
    if rope.yarn is None:
        return PairedRotaryEmbedding(default_inv_freq(dim, rope.theta), max_positions, interleaved=paired)
    return PairedRotaryEmbedding(
        yarn_inv_freq(dim, rope.theta, rope.yarn),
        max_positions,
        cos_sin_factor=rope.yarn.cos_sin_factor(),
        interleaved=paired,
    )


def check_tensor_parallel(dims: DeepseekV3Dims, tp: TensorParallel) -> None:
    """Every count ``tp`` must split, checked before anything is allocated or read: a ConfigError names
    the first that does not divide (heads, then the dense and expert intermediate sizes)."""
    tp.split(dims.num_heads, "num_attention_heads")
    moe_layers = dims.num_layers + dims.num_mtp_layers > dims.first_k_dense_replace
    if min(dims.first_k_dense_replace, dims.num_layers) > 0:
        tp.split(dims.intermediate_size, "intermediate_size")
    if moe_layers:
        tp.split(dims.moe_intermediate_size, "moe_intermediate_size")
        if dims.n_shared_experts:
            tp.split(
                dims.moe_intermediate_size * dims.n_shared_experts, "moe_intermediate_size * n_shared_experts"
            )


class DeepseekV3ForCausalLM(CausalLM):
    @property
    def embeds_on_device(self) -> bool:  # type: ignore[override]
        """V3 embeds in ``forward``; V3.2 is handed its embeddings (see the module docstring)."""
        return self.dims.indexer is None

    @property
    def prefill_graph_tokens(self) -> int:  # type: ignore[override]
        """Short prefill steps run as decode rows (``decode_form``; V3.2's indexer then selects per row,
        as in decode)."""
        return PREFILL_GRAPH_TOKENS

    @property
    def default_block_size(self) -> int:  # type: ignore[override]
        """V3: 64-token pages, where the MLA decode kernel takes in-page key tiles (4096-token contexts on
        the H200: batch 32 9.444 -> 8.932 ms a step, batch 1 unchanged; docs/benchmarks.md). V3.2: 16, as
        its indexer kernels were not measured at 64."""
        return 64 if self.dims.indexer is None else 16

    def __init__(
        self,
        dims: DeepseekV3Dims,
        *,
        dtype: torch.dtype,
        max_model_len: int,
        tp: TensorParallel | None = None,
        drafting: bool = True,
    ) -> None:
        super().__init__()
        self.dims = dims
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.tp = tp = tp or TensorParallel()
        check_tensor_parallel(dims, tp)
        h, rows = dims.hidden_size, vocab_shard(dims.vocab_size, tp.size)
        self.embed_tokens = param(rows, h, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(dims, i, dtype, tp) for i in range(dims.num_layers))
        self.norm = param(h, dtype=dtype)
        self.lm_head = None if dims.tie_word_embeddings else param(rows, h, dtype=dtype)
        # Draft modules only for a run that drafts. V3.2's MTP layer would need its own indexer cache among
        # the draft caches: not served.
        num_mtp = dims.num_mtp_layers if drafting else 0
        self.mtp = nn.ModuleList(
            MultiTokenPredictor(dims, dims.num_layers + k, dtype, tp) for k in range(num_mtp)
        )
        self.rotary = build_rotary(dims, max_model_len)
        self.index_rotary = (
            build_rotary(dims, max_model_len, interleaved=False) if dims.indexer is not None else None
        )

    @classmethod
    def from_hf_config(
        cls,
        hf_config: dict[str, Any],
        model_config: ModelConfig,
        *,
        dtype: torch.dtype,
        max_model_len: int,
        tp: TensorParallel | None = None,
        drafting: bool = True,
    ) -> DeepseekV3ForCausalLM:
        dims = DeepseekV3Dims.from_hf_config(hf_config)
        if getattr(model_config, "quantization", None) == "fp8" and dims.fp8 is None:
            dims = dataclasses.replace(dims, quantize_at_load=True)
        dims = dataclasses.replace(dims, fp8_activations=getattr(model_config, "fp8_activations", False))
        return cls(dims, dtype=dtype, max_model_len=max_model_len, tp=tp, drafting=drafting)

    @staticmethod
    def max_context_length(hf_config: dict[str, Any]) -> int:
        return int(hf_config.get("max_position_embeddings", 4096))

    @property
    def vocab_size(self) -> int:
        return self.dims.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.dims.hidden_size

    @property
    def num_mtp_layers(self) -> int:
        """MTP modules loaded (0 when the config has none or the checkpoint stripped them): the engine
        speculates only when this is > 0."""
        return len(self.mtp)

    def load_weights(self, reader: CheckpointReader) -> None:
        dims = self.dims
        weights = WeightReader(reader, dims.fp8.block if dims.fp8 else None)
        shape = (dims.vocab_size, dims.hidden_size)
        with torch.no_grad():
            self.embed_tokens.copy_(
                weights.get("model.embed_tokens.weight", shape, self.dtype, vocab_split())
            )
            self.norm.copy_(weights.get("model.norm.weight", (dims.hidden_size,), self.dtype))
            if self.lm_head is not None:
                self.lm_head.copy_(weights.get("lm_head.weight", shape, self.dtype, vocab_split()))
        for layer in self.layers:
            layer.load(weights, f"model.layers.{layer.layer_index}.")
        if self.mtp and f"model.layers.{dims.num_layers}.eh_proj.weight" not in reader:
            # Some re-published checkpoints strip the MTP layer the config still announces: serve without it.
            logger.info(
                "the checkpoint has no MTP layer (model.layers.%d.*): drafting is off", dims.num_layers
            )
            self.mtp = nn.ModuleList()
        for module in self.mtp:
            module.load(weights, f"model.layers.{module.layer_index}.")
            module.share_tables(
                self.embed_tokens, self.lm_head if self.lm_head is not None else self.embed_tokens
            )
        self._skip_unbuilt_mtp_layers(reader)

    def _skip_unbuilt_mtp_layers(self, reader: CheckpointReader) -> None:
        """Mark the checkpoint's MTP layers (``model.layers.{num_hidden_layers + k}.*``) that no module was
        built for (not drafting, or V3.2) as deliberately not loaded, saying so once."""
        main = {f"model.layers.{i}." for i in range(self.dims.num_layers)}
        skipped = sorted(
            n
            for n in reader.names()
            if n.startswith("model.layers.")
            and n not in reader.consumed
            and n[: n.index(".", 13) + 1] not in main
        )
        if skipped:
            logger.info(
                "skipping %d MTP tensors (model.layers.%d.* on): no draft module was built",
                len(skipped),
                self.dims.num_layers,
            )
            reader.consumed.update(skipped)

    def _layer_specs(self, layer_index: int) -> list[BufferSpec]:
        """A layer's latent cache; with V3.2's indexer also its indexer key cache."""
        d = self.dims
        specs: list[BufferSpec] = [
            PagedLatentSpec(layer_index, d.kv_lora_rank, d.qk_rope_head_dim, self.dtype)
        ]
        if d.indexer is not None:
            specs.append(PagedLatentSpec(layer_index, d.indexer.head_dim, 0, self.dtype, INDEXER_CACHE))
        return specs

    def buffer_specs(self) -> list[BufferSpec]:
        """One latent cache (``kv_lora_rank + qk_rope_head_dim`` per token) per main layer; for V3.2 also
        one indexer key cache (``index_head_dim`` per token) per layer, named ``INDEXER_CACHE``."""
        return [spec for layer in self.layers for spec in self._layer_specs(layer.layer_index)]

    def mtp_buffer_specs(self) -> list[BufferSpec]:
        """The latent caches of the MTP modules (layer ``num_hidden_layers + k``; V3.2's also their indexer
        key caches), for speculative decoding; not part of ``buffer_specs`` so a run without drafting does
        not pay for them."""
        return [spec for module in self.mtp for spec in self._layer_specs(module.layer_index)]

    def transient_specs(self) -> list[TransientSpec]:
        """Activations per scheduled token (attention projections, expanded prefill keys and values, MoE
        intermediates, the fused MoE's pair rows), in the compute dtype, for this rank's heads and
        intermediate features; the expanded prefill attention of one segment as long as ``max_model_len``
        (or V3.2's indexer selection over it, whichever is larger: they run one after the other); with
        V3.2's indexer, each prefill token's and each decode row's selection over ``max_model_len``
        positions (the decode graphs' static bound; a prefill graph's tokens are decode rows too); with
        block-FP8 projections, the largest one widened to the compute dtype (prefill's cuBLAS operand), or
        under W8A8 each token's widest GEMM input quantized (a byte a value, 4 per 128 for the scales)."""
        d, size = self.dims, self.tp.size
        dtype_bytes = dtype_size(self.dtype)
        attention = mla.prefill_scratch_bytes(d, d.num_heads // size, self.max_model_len, dtype_bytes)
        # q, expanded keys and values, and the absorbed form's query and output latents
        per_head = d.qk_head_dim * 2 + d.v_head_dim * 2 + d.qk_nope_head_dim + 2 * d.kv_lora_rank
        widths = (
            6 * d.hidden_size
            + (d.q_lora_rank or 0)
            + d.kv_lora_rank * 2
            + d.num_heads // size * per_head
            + 3 * max(d.intermediate_size, d.moe_intermediate_size * max(1, d.n_shared_experts)) // size
            # the fused MoE's per-(token, choice) rows: SiLU·mul activations (this rank's features) and
            # weighted outputs (whole hidden rows, summed over the choices after)
            + d.num_experts_per_tok * (d.hidden_size + d.moe_intermediate_size // size)
        )
        specs = []
        if d.indexer is not None:  # indexer queries, key, head weights (float32: counted twice)
            widths += d.indexer.n_heads * (d.indexer.head_dim + 2) + d.indexer.head_dim
            # A decode row's fp32 index, topk's values and int64 indices and their int32 copy.
            per_row = self.max_model_len * 4 + d.indexer.topk * (4 + 8 + 4)
            # Decode rows: one a sequence; a prefill-graph step's: one a token (not at once with decode's).
            specs.append(
                TransientSpec(
                    "deepseek_indexer_decode",
                    bytes_fixed=PREFILL_GRAPH_TOKENS * per_row,
                    bytes_per_seq=per_row,
                )
            )
            specs.append(TransientSpec("deepseek_indexer_prefill", bytes_per_token=self.max_model_len))
            attention = max(attention, indexer.prefill_scratch_bytes(d, self.max_model_len, dtype_bytes))
        if d.fp8_block is not None and not d.fp8_activations:  # prefill widens one projection at a time
            specs.append(
                TransientSpec("deepseek_fp8_widened_weight", bytes_fixed=widened_bytes(self, self.dtype))
            )
        elif d.fp8_block is not None:  # W8A8: a GEMM's input quantized (float8 and its fp32 group scales)
            widest = max(d.hidden_size, d.q_lora_rank or 0, d.num_heads * d.v_head_dim, d.intermediate_size)
            specs.append(TransientSpec("deepseek_fp8_activations", bytes_per_token=widest + widest // 32))
        return [
            TransientSpec("deepseek_activations", bytes_per_token=widths * dtype_bytes),
            TransientSpec("deepseek_prefill_attention", bytes_fixed=attention),
            *specs,
        ]

    def forward(
        self,
        batch: ForwardBatch,
        caches: dict[CacheKey, torch.Tensor],
        states: dict[int, dict[str, torch.Tensor]],
    ) -> torch.Tensor:
        if batch.hidden_states is None:
            if not self.embeds_on_device:
                raise ExecutorError(
                    "DeepSeek-V3.2 does not embed on the device: the batch must carry hidden_states "
                    "(the engine fills them through embed())"
                )
            x = self.embed(batch.token_ids)
        else:
            x = batch.hidden_states.to(self.dtype)
        indexed = self.dims.indexer is not None
        batch = decode_form(batch)
        for layer in self.layers:
            index_cache = caches[cache_key(layer.layer_index, INDEXER_CACHE)] if indexed else None
            x = layer(x, batch, caches[layer.layer_index], self.rotary, index_cache, self.index_rotary)
        return ops.rms_norm(x, self.norm, self.dims.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens if self.lm_head is None else self.lm_head
        return gather_logits(ops.linear(hidden, weight), self.tp, self.dims.vocab_size)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Input embeddings ``[T, H]``, the whole rows on every rank (vocab-parallel + all-reduce)."""
        return vocab_parallel_embed(token_ids, self.embed_tokens, self.tp)

    def mtp_forward(
        self,
        hidden_states: torch.Tensor,
        next_token_ids: torch.Tensor,
        batch: ForwardBatch,
        caches: dict[CacheKey, torch.Tensor],
        *,
        depth: int = 0,
        return_hidden: bool = False,
        logit_rows: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Draft logits ``[T, V]`` (float32) of MTP module ``depth`` for the tokens after next.

        Row r pairs ``hidden_states[r]``, the main model's output (``forward``'s, after the final norm) at
        position ``batch.positions[r]``, with ``next_token_ids[r]``, the token at the following position;
        its logits predict the token one further. ``batch`` addresses the module's own latent cache
        (``caches[num_hidden_layers + depth]``, see ``mtp_buffer_specs``) at the same positions and slots
        as the main model's step, so the main step's ForwardBatch can be reused as it is
        (``batch.hidden_states`` is ignored). With ``return_hidden`` the module's output hidden states
        (the ``h`` of a further drafting step) come back too, for every row. ``logit_rows`` limits the
        logits to those rows (the drafting ones: a prefill chunk only fills the cache).
        """
        if not 0 <= depth < len(self.mtp):
            raise ValueError(
                f"this checkpoint has {len(self.mtp)} MTP module(s); depth {depth} does not exist"
            )
        module = self.mtp[depth]
        batch = decode_form(batch)
        index_cache = caches.get(cache_key(module.layer_index, INDEXER_CACHE))
        hidden = module(
            hidden_states, next_token_ids, batch, caches[module.layer_index], self.rotary, index_cache,
            self.index_rotary,
        )  # fmt: skip
        logits = module.compute_logits(hidden if logit_rows is None else hidden[logit_rows])
        return (logits, hidden) if return_hidden else logits
