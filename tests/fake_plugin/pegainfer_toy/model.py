"""ToyQwen3: a compact Qwen3 written against pegainfer's public plugin API alone, its logits multiplied by
``model.logit_scale``.

A decoder layer is transformers' Qwen3 op for op: RMSNorm, q/k/v projections, per-head q/k RMSNorm,
rotary, GQA attention through the paged cache, o_proj, RMSNorm, SwiGLU MLP. At ``logit_scale`` 1 the
float32 logits are transformers'. Every op is a ``pegainfer.layers`` torch reference (the oracle the
core's kernels are checked against), so the toy runs wherever torch does, unfused.

Under tensor parallelism each rank holds its query heads, its key/value heads (replicated when there are
fewer than ranks), its share of the MLP and its rows of the vocabulary; o_proj and down_proj are
row-parallel, their partial sums all-reduced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pegainfer import ops
from pegainfer.config.schema import ModelConfig
from pegainfer.errors import CheckpointError
from pegainfer.layers.activation import interleave_gate_up
from pegainfer.layers.attention import write_kv
from pegainfer.layers.parallel import gather_logits, vocab_parallel_embed
from pegainfer.layers.rotary import RotaryEmbedding, rope_parameters
from pegainfer.memory.buffer_specs import BufferSpec, CacheKey, PagedKVSpec, TransientSpec, dtype_size
from pegainfer.model.checkpoint import CheckpointReader
from pegainfer.model.model_api import CausalLM, ForwardBatch
from pegainfer.parallel.distributed import TensorParallel
from pegainfer.parallel.sharding import split, vocab_shard, vocab_split
from pegainfer_toy.config import ToyQwen3Config

# Qwen3 options this toy does not implement: a checkpoint that sets them is refused, not misread.
_UNSUPPORTED = {"attention_bias": False, "use_sliding_window": False, "hidden_act": "silu"}


@dataclass(frozen=True)
class ToyDims:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_type: str
    tie_word_embeddings: bool

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ToyDims:
        def need(key: str) -> Any:
            if key not in cfg:
                raise CheckpointError(f"config.json lacks '{key}', which a ToyQwen3 checkpoint must have")
            return cfg[key]

        for key, supported in _UNSUPPORTED.items():
            if cfg.get(key, supported) != supported:
                raise CheckpointError(
                    f"config.json: {key}={cfg[key]!r} is not supported by ToyQwen3 (only {supported!r})"
                )
        heads = need("num_attention_heads")
        theta, rope_type = rope_parameters(cfg)
        dims = cls(
            vocab_size=need("vocab_size"),
            hidden_size=need("hidden_size"),
            intermediate_size=need("intermediate_size"),
            num_layers=need("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or need("hidden_size") // heads,
            rms_norm_eps=need("rms_norm_eps"),
            rope_theta=theta,
            rope_type=rope_type,
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        )
        if dims.num_heads % dims.num_kv_heads:
            raise CheckpointError(
                f"config.json: num_attention_heads ({heads}) must be a multiple of "
                f"num_key_value_heads ({dims.num_kv_heads})"
            )
        return dims


def _weight(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class ToyDecoderLayer(nn.Module):
    def __init__(self, dims: ToyDims, tp: TensorParallel, index: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.dims, self.tp, self.index = dims, tp, index
        # This rank's shard, checked here so that a tp that does not divide fails before any weight is read.
        self.num_heads = tp.split(dims.num_heads, "num_attention_heads")
        self.num_kv_heads, _ = tp.heads(dims.num_kv_heads, "num_key_value_heads")
        self.kv_pieces = min(dims.num_kv_heads, tp.size)  # distinct k/v shards (fewer than ranks: replicated)
        self.intermediate = tp.split(dims.intermediate_size, "intermediate_size")
        h, d = dims.hidden_size, dims.head_dim
        self.input_layernorm = _weight(h, dtype=dtype)
        self.q_proj = _weight(self.num_heads * d, h, dtype=dtype)
        self.k_proj = _weight(self.num_kv_heads * d, h, dtype=dtype)
        self.v_proj = _weight(self.num_kv_heads * d, h, dtype=dtype)
        self.q_norm = _weight(d, dtype=dtype)
        self.k_norm = _weight(d, dtype=dtype)
        self.o_proj = _weight(h, self.num_heads * d, dtype=dtype)
        self.post_attention_layernorm = _weight(h, dtype=dtype)
        self.gate_up_proj = _weight(2 * self.intermediate, h, dtype=dtype)  # rows alternate gate, up
        self.down_proj = _weight(h, self.intermediate, dtype=dtype)

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, cache: torch.Tensor, rotary: RotaryEmbedding
    ) -> torch.Tensor:
        t, d, eps = x.shape[0], self.dims.head_dim, self.dims.rms_norm_eps
        h = ops.rms_norm(x, self.input_layernorm, eps)
        q = ops.rms_norm(ops.linear(h, self.q_proj).view(t, self.num_heads, d), self.q_norm, eps)
        k = ops.rms_norm(ops.linear(h, self.k_proj).view(t, self.num_kv_heads, d), self.k_norm, eps)
        v = ops.linear(h, self.v_proj).view(t, self.num_kv_heads, d)
        q, k = rotary(batch.positions, q, k)
        # This step's keys and values go into their pages first: the attention reads the whole context there.
        write_kv(cache, k, v, batch.attn.slot_mapping)
        attn = ops.paged_attention(q, cache, batch.attn, d**-0.5)
        x = x + self.tp.all_reduce(ops.linear(attn.reshape(t, -1), self.o_proj))
        h = ops.rms_norm(x, self.post_attention_layernorm, eps)
        return x + self.tp.all_reduce(
            ops.linear(ops.silu_mul(ops.linear(h, self.gate_up_proj)), self.down_proj)
        )

    def load(self, reader: CheckpointReader, prefix: str) -> None:
        h, d, i = self.dims.hidden_size, self.dims.head_dim, self.dims.intermediate_size
        q, kv = self.dims.num_heads * d, self.dims.num_kv_heads * d
        # Column-parallel projections read their output rows, row-parallel ones their input columns.
        rows, kv_rows, columns = split(0), split(0, self.kv_pieces), split(1)

        def get(name: str, shape: tuple[int, ...], shard: Any = None) -> torch.Tensor:
            return reader.get(prefix + name, shape, self.q_proj.dtype, shard)

        self.input_layernorm.copy_(get("input_layernorm.weight", (h,)))
        self.q_proj.copy_(get("self_attn.q_proj.weight", (q, h), rows))
        self.k_proj.copy_(get("self_attn.k_proj.weight", (kv, h), kv_rows))
        self.v_proj.copy_(get("self_attn.v_proj.weight", (kv, h), kv_rows))
        self.q_norm.copy_(get("self_attn.q_norm.weight", (d,)))
        self.k_norm.copy_(get("self_attn.k_norm.weight", (d,)))
        self.o_proj.copy_(get("self_attn.o_proj.weight", (h, q), columns))
        self.post_attention_layernorm.copy_(get("post_attention_layernorm.weight", (h,)))
        gate, up = get("mlp.gate_proj.weight", (i, h), rows), get("mlp.up_proj.weight", (i, h), rows)
        self.gate_up_proj.copy_(interleave_gate_up(gate, up))
        self.down_proj.copy_(get("mlp.down_proj.weight", (h, i), columns))


class ToyQwen3ForCausalLM(CausalLM):
    """A Qwen3 checkpoint labelled ``ToyQwen3ForCausalLM``, its logits multiplied by ``logit_scale``."""

    def __init__(
        self,
        dims: ToyDims,
        *,
        dtype: torch.dtype,
        max_model_len: int,
        logit_scale: float = 1.0,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        self.dims, self.dtype, self.max_model_len, self.logit_scale = dims, dtype, max_model_len, logit_scale
        self.tp = tp = tp or TensorParallel()
        rows = vocab_shard(dims.vocab_size, tp.size)  # this rank's slice of the vocab-parallel tables
        self.embed_tokens = _weight(rows, dims.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(ToyDecoderLayer(dims, tp, i, dtype) for i in range(dims.num_layers))
        self.norm = _weight(dims.hidden_size, dtype=dtype)
        self.lm_head = None if dims.tie_word_embeddings else _weight(rows, dims.hidden_size, dtype=dtype)
        self.rotary = RotaryEmbedding(dims.head_dim, dims.rope_theta, max_model_len, dims.rope_type)

    @classmethod
    def from_hf_config(
        cls,
        hf_config: dict[str, Any],
        model_config: ModelConfig,
        *,
        dtype: torch.dtype,
        max_model_len: int,
        tp: TensorParallel | None = None,
    ) -> ToyQwen3ForCausalLM:
        assert isinstance(model_config, ToyQwen3Config)  # the core hands a plugin its own schema
        return cls(
            ToyDims.from_hf_config(hf_config),
            dtype=dtype,
            max_model_len=max_model_len,
            logit_scale=model_config.logit_scale,
            tp=tp,
        )

    @staticmethod
    def max_context_length(hf_config: dict[str, Any]) -> int:
        return int(hf_config.get("max_position_embeddings", 40960))

    @property
    def vocab_size(self) -> int:
        return self.dims.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.dims.hidden_size

    @torch.no_grad()
    def load_weights(self, reader: CheckpointReader) -> None:
        table = (self.dims.vocab_size, self.dims.hidden_size)
        self.embed_tokens.copy_(reader.get("model.embed_tokens.weight", table, self.dtype, vocab_split()))
        for layer in self.layers:
            layer.load(reader, f"model.layers.{layer.index}.")
        self.norm.copy_(reader.get("model.norm.weight", (self.dims.hidden_size,), self.dtype))
        if self.lm_head is not None:
            self.lm_head.copy_(reader.get("lm_head.weight", table, self.dtype, vocab_split()))

    def buffer_specs(self) -> list[BufferSpec]:
        return [
            PagedKVSpec(layer.index, layer.num_kv_heads, self.dims.head_dim, self.dtype)
            for layer in self.layers
        ]

    def transient_specs(self) -> list[TransientSpec]:
        layer, d = self.layers[0], self.dims
        q, kv = layer.num_heads * d.head_dim, layer.num_kv_heads * d.head_dim
        # Live at once inside a layer: the residual stream, its normed copy and a projection's output; q and
        # k with their normed and rotated copies, v, the attention output; gate|up and its activation; and
        # RMSNorm's float32 temporaries.
        activations = 3 * d.hidden_size + 4 * q + 4 * kv + 3 * layer.intermediate
        per_token = dtype_size(self.dtype) * activations + 4 * 2 * d.hidden_size
        scratch = ops.attention_scratch(
            layer.num_heads,
            layer.num_kv_heads,
            d.head_dim,
            self.max_model_len,
            self.dtype,
            self.embed_tokens.device,
        )
        return [TransientSpec("activations", bytes_per_token=per_token), scratch]

    def forward(
        self,
        batch: ForwardBatch,
        caches: dict[CacheKey, torch.Tensor],
        states: dict[int, dict[str, torch.Tensor]],
    ) -> torch.Tensor:
        x = self.embed(batch.token_ids)
        for layer in self.layers:
            x = layer(x, batch, caches[layer.index], self.rotary)
        return ops.rms_norm(x, self.norm, self.dims.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return gather_logits(ops.linear(hidden, head), self.tp, self.dims.vocab_size) * self.logit_scale

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_embed(token_ids, self.embed_tokens, self.tp)
