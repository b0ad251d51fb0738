"""Qwen3.5 hybrid (dense and MoE) and Qwen3-Next: Gated DeltaNet and gated full attention layers, per
``layer_types``.

Each layer: ``h = x + Mixer(norm1(x)); x = h + FFN(norm2(h))`` with zero-centred ``(1 + w)`` RMSNorms;
the mixer is a Gated DeltaNet (``linear_attention``) or gated softmax attention (``full_attention``), the
FFN a SwiGLU MLP or the sparse MoE block (per layer under Qwen3-Next: ``Qwen35Config.is_moe_layer``). Then the final zero-centred norm and ``lm_head``.

Memory: full-attention layers use the paged KV cache; each GDN layer keeps its conv window and delta-rule
state in the request's state slot (``RecurrentStateSpec``). A forward allocates its pass buffers once
(``pass_buffers.py``) and every layer reuses them. The language model and its MTP draft module (``mtp.py``,
when the checkpoint holds it whole) are loaded; the vision tower of the published checkpoints is skipped
with a log line.

Tensor parallelism (``tp``): every rank holds its heads of each mixer and its share of each FFN's features
(``Qwen35Shard``, checked before any weight is read; see each module for its split), the rows of the
vocab-parallel embedding and lm_head, and replicated layer norms and final norm. Each layer all-reduces
its mixer's and its FFN's partial outputs in place; the caches, slot states and pass buffers are sized
from the rank's geometry. At tp = 1 every collective is a no-op and the model is the single-rank one.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
from torch import nn

from pegainfer import ops
from pegainfer.config.schema import ModelConfig
from pegainfer.layers.attention import prefill_graph_real_tokens
from pegainfer.layers.parallel import gather_logits, vocab_parallel_embed
from pegainfer.layers.rotary import RotaryEmbedding
from pegainfer.memory.buffer_specs import BufferSpec, CacheKey, TransientSpec
from pegainfer.model.checkpoint import CheckpointReader
from pegainfer.model.model_api import CausalLM, ForwardBatch
from pegainfer.parallel.distributed import TensorParallel
from pegainfer.parallel.sharding import vocab_shard, vocab_split
from pegainfer_qwen35 import pass_buffers
from pegainfer_qwen35.attention import GatedAttention
from pegainfer_qwen35.config import FULL, LINEAR, Qwen35Config, Qwen35Shard, text_part
from pegainfer_qwen35.gated_deltanet import (
    RECURRENT_PREFILL_MAX_TOKENS,
    GatedDeltaNet,
    RecurrentRows,
    fla_chunk_rule,
    gdn_kernels_enabled,
)
from pegainfer_qwen35.mlp import DenseMLP
from pegainfer_qwen35.moe import SparseMoE
from pegainfer_qwen35.mtp import MultiTokenPredictor
from pegainfer_qwen35.norms import rms_norm_zero_centred
from pegainfer_qwen35.pass_buffers import PassBuffers
from pegainfer_qwen35.projections import FoldedNorm, fold_norm

logger = logging.getLogger(__name__)

#: Checkpoint parts a text engine does not run: (name prefix, what it is, why). The MTP module is one of them
#: when it is not loaded (not drafting, stripped to its head, or a checkpoint of several MTP layers: only
#: the first runs).
SKIPPED_PARTS = (
    ("model.visual.", "vision-tower", "pegainfer runs the language model only"),
    ("mtp.", "MTP", "drafting is off or cannot use them"),
)


class Qwen35DecoderLayer(nn.Module):
    def __init__(
        self,
        config: Qwen35Config,
        layer_index: int,
        dtype: torch.dtype,
        shard: Qwen35Shard | None = None,
        tp: TensorParallel | None = None,
        *,
        draft: bool = False,
    ) -> None:
        """``draft``: the MTP module's layer (index ``num_layers`` and on): full attention, and the MoE block
        whenever the model has experts."""
        super().__init__()
        self.config = config
        self.layer_index = layer_index
        self.kind = FULL if draft else config.layer_types[layer_index]
        moe = config.num_experts > 0 if draft else config.is_moe_layer(layer_index)
        tp = tp or TensorParallel()
        shard = shard or Qwen35Shard.of(config, tp)
        h = config.hidden_size
        self.mixer: GatedDeltaNet | GatedAttention = (
            GatedDeltaNet(config, layer_index, dtype, shard, tp)
            if self.kind == LINEAR
            else GatedAttention(config, layer_index, dtype, shard, tp)
        )
        self.mlp: SparseMoE | DenseMLP = (
            SparseMoE(config, dtype, shard, tp) if moe else DenseMLP(h, config.intermediate_size, dtype, tp)
        )
        # The input norm lives folded in the mixer's first projection, the dense MLP's norm in gate|up;
        # the MoE block's several consumers (router, experts, shared expert) take the normed rows.
        self.post_attention_layernorm = (
            nn.Parameter(torch.empty(h, dtype=dtype), requires_grad=False)
            if isinstance(self.mlp, SparseMoE)
            else None
        )

    def buffer_spec(self) -> BufferSpec:
        if isinstance(self.mixer, GatedDeltaNet):
            return self.mixer.state_spec()
        return self.mixer.cache_spec()

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        rows: RecurrentRows | None,
        cache: torch.Tensor | None,
        state: dict[str, torch.Tensor] | None,
        rotary: RotaryEmbedding | None,
        bufs: PassBuffers,
    ) -> None:
        """The layer on the residual stream ``x``, in place: the mixer's and the FFN's outputs are added
        to it (inside their output GEMMs where the skinny kernel runs)."""
        eps = self.config.rms_norm_eps
        folded = FoldedNorm(eps, bufs.normed)
        if isinstance(self.mixer, GatedDeltaNet):
            self.mixer(x, rows, state, bufs, residual=x, norm=folded)
        else:
            self.mixer(x, batch, cache, rotary, bufs, residual=x, norm=folded)
        # Decode-only steps and short prefill steps run inside CUDA graphs: the FFN must not sync there.
        static = not batch.attn.prefills or batch.attn.in_graph
        if isinstance(self.mlp, DenseMLP):
            self.mlp(x, bufs, static_shapes=static, residual=x, norm=folded)
        else:  # the block norms x itself (inside its router's GEMV where it can)
            real = prefill_graph_real_tokens(batch.attn)  # a prefill graph's padding routes as row 0
            self.mlp(
                x, bufs, static_shapes=static, residual=x, norm=self.post_attention_layernorm, real_rows=real
            )

    def load(self, reader: CheckpointReader, prefix: str) -> None:
        h = self.config.hidden_size
        mixer = "linear_attn." if self.kind == LINEAR else "self_attn."
        self.mixer.load(reader, prefix + mixer)
        self.mlp.load(reader, prefix + "mlp.")
        dtype = self.mixer.first_projection.dtype
        input_norm = reader.get(prefix + "input_layernorm.weight", (h,), dtype)
        post_norm = reader.get(prefix + "post_attention_layernorm.weight", (h,), dtype)
        with torch.no_grad():
            first = self.mixer.first_projection
            first.copy_(fold_norm(first, input_norm))
            if self.post_attention_layernorm is None:
                self.mlp.gate_up_proj.copy_(fold_norm(self.mlp.gate_up_proj, post_norm))
            else:
                self.post_attention_layernorm.copy_(post_norm)


class Qwen35ForCausalLM(CausalLM):
    #: A short chunk crossing a snapshot boundary saves the GDN state there itself (``GatedDeltaNet``): a
    #: prompt's tail after a hit is one step, not two. Bounded so the GPU's token-by-token form stays short.
    snapshot_inside_chunk_tokens = RECURRENT_PREFILL_MAX_TOKENS

    @property
    def prefill_graph_tokens(self) -> int:
        """Prefill steps this short run the GDN prefill kernels, which read the segments' device form
        (``RecurrentRows``); the torch and fla forms read them on the host and never run in a graph."""
        return RECURRENT_PREFILL_MAX_TOKENS if gdn_kernels_enabled() else 0

    def __init__(
        self,
        config: Qwen35Config,
        *,
        dtype: torch.dtype,
        max_model_len: int,
        tp: TensorParallel | None = None,
        drafting: bool = True,
    ) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.tp = tp = tp or TensorParallel()
        # Every head and feature count is checked against tp here, before any weight is read.
        self.shard = shard = Qwen35Shard.of(config, tp)
        h, rows = config.hidden_size, vocab_shard(config.vocab_size, tp.size)
        self.embed_tokens = nn.Parameter(torch.empty(rows, h, dtype=dtype), requires_grad=False)
        self.layers = nn.ModuleList(
            Qwen35DecoderLayer(config, i, dtype, shard, tp) for i in range(config.num_layers)
        )
        self.norm = nn.Parameter(torch.empty(h, dtype=dtype), requires_grad=False)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Parameter(torch.empty(rows, h, dtype=dtype), requires_grad=False)
        )
        # The draft module's decoder layer comes after the main ones (its cache is layer num_layers). Built
        # only for a run that drafts: at 35B-A3B it holds ~1.6 GB.
        self.mtp = nn.ModuleList(
            MultiTokenPredictor(
                config, Qwen35DecoderLayer(config, config.num_layers, dtype, shard, tp, draft=True), dtype, tp
            )
            for _ in range(min(config.num_mtp_layers, 1) if drafting else 0)
        )
        self.rotary = (
            RotaryEmbedding(config.rotary_dim, config.rope_theta, max_model_len)
            if config.layers_of(FULL) or self.mtp
            else None
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
    ) -> Qwen35ForCausalLM:
        config = Qwen35Config.from_hf_config(hf_config)
        return cls(config, dtype=dtype, max_model_len=max_model_len, tp=tp, drafting=drafting)

    @staticmethod
    def max_context_length(hf_config: dict[str, Any]) -> int:
        return int(text_part(hf_config).get("max_position_embeddings", 32768))

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    # ------------------------------------------------------------------------------------------ weights

    def load_weights(self, reader: CheckpointReader) -> None:
        c = self.config
        table = (c.vocab_size, c.hidden_size)
        # The published VLM files nest the language model; text-only files keep it at ``model.``.
        prefix = "model.language_model." if "model.language_model.embed_tokens.weight" in reader else "model."
        with torch.no_grad():
            self.embed_tokens.copy_(
                reader.get(prefix + "embed_tokens.weight", table, self.dtype, vocab_split())
            )
            for layer in self.layers:
                layer.load(reader, f"{prefix}layers.{layer.layer_index}.")
            self.norm.copy_(reader.get(prefix + "norm.weight", (c.hidden_size,), self.dtype))
            if self.lm_head is not None:
                self.lm_head.copy_(reader.get("lm_head.weight", table, self.dtype, vocab_split()))
        if self.mtp and not MultiTokenPredictor.present_in(reader):
            logger.info("the checkpoint has no whole MTP module (mtp.fc, mtp.layers.0.*): drafting is off")
            self.mtp = nn.ModuleList()
        for module in self.mtp:
            module.load(reader)
        self._skip_unused_parts(reader)

    def _skip_unused_parts(self, reader: CheckpointReader) -> None:
        """Mark the vision tower and an MTP module not built or not whole as handled (deliberately not
        loaded), saying so once each."""
        names = reader.names()
        for part, what, why in SKIPPED_PARTS:
            skipped = sorted(n for n in names if n.startswith(part) and n not in reader.consumed)
            if skipped:
                logger.info("skipping %d %s tensors (%s*): %s", len(skipped), what, part, why)
                reader.consumed.update(skipped)
        if self.lm_head is None and "lm_head.weight" in names:
            logger.info("tie_word_embeddings is set: the checkpoint's lm_head.weight is not used")
            reader.consumed.add("lm_head.weight")

    # ----------------------------------------------------------------------------------------- buffers

    def buffer_specs(self) -> list[BufferSpec]:
        return [layer.buffer_spec() for layer in self.layers]

    @property
    def num_mtp_layers(self) -> int:
        """MTP modules loaded (0 when the config announces none or the checkpoint lacks it)."""
        return len(self.mtp)

    def mtp_buffer_specs(self) -> list[BufferSpec]:
        """The MTP layer's paged KV cache (layer ``num_hidden_layers``), for speculative decoding only."""
        return [module.layer.buffer_spec() for module in self.mtp]

    @functools.cached_property
    def kernel_path(self) -> bool:
        """Whether forwards take the CUDA kernels throughout (fused MoE, the GDN kernels, fla's chunked
        prefill), whose temporaries ``transient_specs`` then bounds instead of the reference path's.
        Decided once, at the first ask (the memory plan's), so the pass buffers stay the planned ones. Where
        fla is turned off later (``PEGAINFER_QWEN35_FLA=0``, the benchmarks' comparison) or fails (logged),
        long prefills run the torch chunked form beyond that reserve."""
        return (
            self.embed_tokens.device.type == "cuda" and gdn_kernels_enabled() and fla_chunk_rule() is not None
        )

    @property
    def pass_buffer_roles(self) -> list[pass_buffers.Role]:
        return pass_buffers.pass_buffer_roles(self.config, self.dtype, self.shard, kernels=self.kernel_path)

    def transient_specs(self) -> list[TransientSpec]:
        return pass_buffers.transient_specs(
            self.config, self.dtype, self.shard, device=self.embed_tokens.device,
            max_model_len=self.max_model_len, kernels=self.kernel_path,
        )  # fmt: skip

    def allocate_pass_buffers(self, num_tokens: int) -> PassBuffers:
        """The buffers one forward of ``num_tokens`` rows uses (what ``transient_specs`` reserves)."""
        return PassBuffers(self.pass_buffer_roles, num_tokens, self.embed_tokens.device)

    # ----------------------------------------------------------------------------------------- forward

    def forward(
        self,
        batch: ForwardBatch,
        caches: dict[CacheKey, torch.Tensor],
        states: dict[int, dict[str, torch.Tensor]],
    ) -> torch.Tensor:
        bufs = self.allocate_pass_buffers(batch.token_ids.shape[0])
        x = bufs.hidden  # the residual stream, updated in place by every layer
        if self.tp.size == 1:
            torch.index_select(self.embed_tokens, 0, batch.token_ids, out=x)
        else:
            x.copy_(vocab_parallel_embed(batch.token_ids, self.embed_tokens, self.tp))
        rows = RecurrentRows.from_batch(batch) if self.config.layers_of(LINEAR) else None
        for layer in self.layers:
            i = layer.layer_index
            layer(x, batch, rows, caches.get(i), states.get(i), self.rotary, bufs)
        return rms_norm_zero_centred(x, self.norm, self.config.rms_norm_eps, out=bufs.normed)

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
        """Draft logits (float32) of the MTP module for the token after next (``CausalLM.mtp_forward``):
        row r pairs the final hidden state at ``batch.positions[r]`` with ``next_token_ids[r]`` and writes
        the module's KV there."""
        if not 0 <= depth < len(self.mtp):
            raise ValueError(
                f"this checkpoint has {len(self.mtp)} MTP module(s); depth {depth} does not exist"
            )
        module = self.mtp[depth]
        bufs = self.allocate_pass_buffers(next_token_ids.shape[0])
        x = module.combine(self.embed(next_token_ids), hidden_states, out=bufs.hidden)
        module.layer(x, batch, None, caches.get(module.layer_index), None, self.rotary, bufs)
        out = rms_norm_zero_centred(x, module.norm, self.config.rms_norm_eps)
        rows = out if logit_rows is None else out.index_select(0, logit_rows)
        logits = self.compute_logits(rows).float()
        return (logits, out) if return_hidden else logits

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens if self.lm_head is None else self.lm_head
        return gather_logits(ops.linear(hidden, weight), self.tp, self.config.vocab_size)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_embed(token_ids, self.embed_tokens, self.tp)
