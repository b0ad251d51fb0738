"""Qwen3 dense (``Qwen3ForCausalLM``): q/k RMSNorm before rotary, GQA, SwiGLU, tied or untied embeddings.

Any Qwen3 dense size loads (0.6B-32B); 14B is the flagship. q|k|v and gate|up are packed into one
weight each at load time, so each is one GEMM; gate and up rows alternate, and each RMSNorm's weight
is folded into the projection it feeds (input norm into q|k|v, post-attention norm into gate|up, the
final norm into an untied lm_head). So at decode the norms, SiLU·mul and the residual adds run inside the
skinny GEMMs and q/k norm + rotary inside the decode attention (pegainfer.ops): six launches a layer
instead of ten.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pegainfer import ops
from pegainfer.config.schema import ModelConfig
from pegainfer.errors import CheckpointError
from pegainfer.layers.activation import interleave_gate_up
from pegainfer.layers.norm import fold_rms_norm_weight
from pegainfer.layers.parallel import gather_logits, vocab_parallel_embed
from pegainfer.layers.rotary import RotaryEmbedding, rope_parameters
from pegainfer.memory.buffer_specs import BufferSpec, CacheKey, PagedKVSpec, TransientSpec, dtype_size
from pegainfer.model.checkpoint import CheckpointReader
from pegainfer.model.model_api import CausalLM, ForwardBatch
from pegainfer.ops import attention_scratch
from pegainfer.parallel.distributed import TensorParallel
from pegainfer.parallel.sharding import Shard, split, vocab_shard, vocab_split


@dataclass(frozen=True)
class Qwen3Dims:
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
    attention_bias: bool
    max_position_embeddings: int

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> Qwen3Dims:
        def need(key: str) -> Any:
            if key not in cfg:
                raise CheckpointError(f"config.json lacks '{key}', which a Qwen3 checkpoint must have")
            return cfg[key]

        num_heads = need("num_attention_heads")
        theta, rope_type = rope_parameters(cfg)
        dims = cls(
            vocab_size=need("vocab_size"),
            hidden_size=need("hidden_size"),
            intermediate_size=need("intermediate_size"),
            num_layers=need("num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or need("hidden_size") // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_type=rope_type,
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", False),
            max_position_embeddings=cfg.get("max_position_embeddings", 40960),
        )
        if dims.num_heads % dims.num_kv_heads:
            raise CheckpointError(
                f"config.json: num_attention_heads ({dims.num_heads}) must be a multiple of "
                f"num_key_value_heads ({dims.num_kv_heads})"
            )
        return dims


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


@dataclass(frozen=True)
class Qwen3Shard:
    """What one tensor-parallel rank holds of each layer: its query heads, its key/value heads (replicated
    when there are fewer than ranks) and its share of the MLP's intermediate features."""

    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    kv_pieces: int  # how many distinct key/value shards there are (the kv head count when replicated)

    @classmethod
    def of(cls, dims: Qwen3Dims, tp: TensorParallel) -> Qwen3Shard:
        num_kv_heads, _ = tp.heads(dims.num_kv_heads, "num_key_value_heads")
        return cls(
            num_heads=tp.split(dims.num_heads, "num_attention_heads"),
            num_kv_heads=num_kv_heads,
            intermediate_size=tp.split(dims.intermediate_size, "intermediate_size"),
            kv_pieces=min(dims.num_kv_heads, tp.size),
        )


class Qwen3DecoderLayer(nn.Module):
    def __init__(
        self, dims: Qwen3Dims, shard: Qwen3Shard, tp: TensorParallel, layer_index: int, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.dims, self.shard, self.tp = dims, shard, tp
        d, h = dims.head_dim, dims.hidden_size
        self.q_size, self.kv_size = shard.num_heads * d, shard.num_kv_heads * d
        # input_layernorm's weight lives in qkv_proj's columns, post_attention_layernorm's in gate_up_proj's.
        self.qkv_proj = _param(self.q_size + 2 * self.kv_size, h, dtype=dtype)
        self.qkv_bias = _param(self.q_size + 2 * self.kv_size, dtype=dtype) if dims.attention_bias else None
        self.q_norm = _param(d, dtype=dtype)
        self.k_norm = _param(d, dtype=dtype)
        self.o_proj = _param(h, self.q_size, dtype=dtype)
        self.gate_up_proj = _param(2 * shard.intermediate_size, h, dtype=dtype)
        self.down_proj = _param(h, shard.intermediate_size, dtype=dtype)
        self.scale = d**-0.5

    def forward(
        self,
        residual: torch.Tensor,
        delta: torch.Tensor | None,
        batch: ForwardBatch,
        cache: torch.Tensor,
        rotary: RotaryEmbedding,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``residual + delta`` is the layer's input (``delta``: the previous layer's MLP output when it was
        not added inside its GEMM, see ``ops.residual_linear``); returns the same pair after the layer."""
        dims, shard, eps, t = self.dims, self.shard, self.dims.rms_norm_eps, residual.shape[0]
        qkv, residual = ops.norm_linear(residual, delta, self.qkv_proj, eps, self.qkv_bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        attn = ops.qk_norm_rope_attention(
            q.view(t, shard.num_heads, dims.head_dim),
            k.view(t, shard.num_kv_heads, dims.head_dim),
            v.view(t, shard.num_kv_heads, dims.head_dim),
            self.q_norm,
            self.k_norm,
            rotary,
            batch.positions,
            eps,
            cache,
            batch.attn,
            self.scale,
        )
        residual, delta = ops.residual_linear(attn.reshape(t, self.q_size), self.o_proj, residual, self.tp)
        act, residual = ops.norm_linear(residual, delta, self.gate_up_proj, eps, silu=True)
        return ops.residual_linear(act, self.down_proj, residual, self.tp)

    def load(self, reader: CheckpointReader, prefix: str) -> None:
        dims, h, d = self.dims, self.dims.hidden_size, self.dims.head_dim
        dtype = self.qkv_proj.dtype
        q, kv = dims.num_heads * d, dims.num_kv_heads * d
        # Column-parallel: this rank's heads (k/v split into as many pieces as there are distinct shards);
        # row-parallel o_proj and down_proj: the matching input columns.
        heads, kv_heads, columns = split(0), split(0, self.shard.kv_pieces), split(1)

        def get(name: str, shape: tuple[int, ...], shard: Shard | None = None) -> torch.Tensor:
            return reader.get(prefix + name, shape, dtype, shard)

        with torch.no_grad():
            qkv = torch.cat(
                [
                    get("self_attn.q_proj.weight", (q, h), heads),
                    get("self_attn.k_proj.weight", (kv, h), kv_heads),
                    get("self_attn.v_proj.weight", (kv, h), kv_heads),
                ]
            )
            self.qkv_proj.copy_(fold_rms_norm_weight(qkv, get("input_layernorm.weight", (h,))))
            if self.qkv_bias is not None:
                self.qkv_bias.copy_(
                    torch.cat(
                        [
                            get("self_attn.q_proj.bias", (q,), heads),
                            get("self_attn.k_proj.bias", (kv,), kv_heads),
                            get("self_attn.v_proj.bias", (kv,), kv_heads),
                        ]
                    )
                )
            self.q_norm.copy_(get("self_attn.q_norm.weight", (d,)))
            self.k_norm.copy_(get("self_attn.k_norm.weight", (d,)))
            self.o_proj.copy_(get("self_attn.o_proj.weight", (h, q), columns))
            i = dims.intermediate_size
            gate_up = interleave_gate_up(
                get("mlp.gate_proj.weight", (i, h), heads), get("mlp.up_proj.weight", (i, h), heads)
            )
            self.gate_up_proj.copy_(
                fold_rms_norm_weight(gate_up, get("post_attention_layernorm.weight", (h,)))
            )
            self.down_proj.copy_(get("mlp.down_proj.weight", (h, i), columns))


class Qwen3ForCausalLM(CausalLM):
    """Under tensor parallelism each rank holds its heads of q|k|v and o_proj, its share of gate|up and
    down (o_proj and down all-reduced), and its rows of the vocab-parallel embedding and lm_head."""

    @property
    def prefill_graph_tokens(self) -> int:
        """The forward reads the prefill segments through ``ops``' kernels only, which take their device
        form: a step of any size can run in a CUDA graph (the engine's cap decides). The torch
        references read them on the host."""
        return sys.maxsize if ops.triton_enabled() else 0

    def __init__(
        self, dims: Qwen3Dims, *, dtype: torch.dtype, max_model_len: int, tp: TensorParallel | None = None
    ) -> None:
        super().__init__()
        self.dims = dims
        self.dtype = dtype
        self.tp = tp = tp or TensorParallel()
        self.shard = shard = Qwen3Shard.of(dims, tp)
        rows = vocab_shard(dims.vocab_size, tp.size)
        self.embed_tokens = _param(rows, dims.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(
            Qwen3DecoderLayer(dims, shard, tp, i, dtype) for i in range(dims.num_layers)
        )
        # The final norm's weight is folded into an untied lm_head; tied, it stays (the embedding is shared).
        tied = dims.tie_word_embeddings
        self.norm = _param(dims.hidden_size, dtype=dtype) if tied else None
        self.lm_head = None if tied else _param(rows, dims.hidden_size, dtype=dtype)
        self.rotary = RotaryEmbedding(dims.head_dim, dims.rope_theta, max_model_len, dims.rope_type)
        self.max_model_len = max_model_len

    @classmethod
    def from_hf_config(
        cls,
        hf_config: dict[str, Any],
        model_config: ModelConfig,
        *,
        dtype: torch.dtype,
        max_model_len: int,
        tp: TensorParallel | None = None,
    ) -> Qwen3ForCausalLM:
        return cls(Qwen3Dims.from_hf_config(hf_config), dtype=dtype, max_model_len=max_model_len, tp=tp)

    @staticmethod
    def max_context_length(hf_config: dict[str, Any]) -> int:
        return int(hf_config.get("max_position_embeddings", 40960))

    @property
    def vocab_size(self) -> int:
        return self.dims.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.dims.hidden_size

    def load_weights(self, reader: CheckpointReader) -> None:
        dims = self.dims
        table = (dims.vocab_size, dims.hidden_size)
        with torch.no_grad():
            self.embed_tokens.copy_(reader.get("model.embed_tokens.weight", table, self.dtype, vocab_split()))
            for layer in self.layers:
                layer.load(reader, f"model.layers.{layer.layer_index}.")
            norm = reader.get("model.norm.weight", (dims.hidden_size,), self.dtype)
            if self.lm_head is None:
                self.norm.copy_(norm)
            else:
                lm_head = reader.get("lm_head.weight", table, self.dtype, vocab_split())
                self.lm_head.copy_(fold_rms_norm_weight(lm_head, norm))

    def buffer_specs(self) -> list[BufferSpec]:
        return [
            PagedKVSpec(layer.layer_index, self.shard.num_kv_heads, self.dims.head_dim, self.dtype)
            for layer in self.layers
        ]

    def transient_specs(self) -> list[TransientSpec]:
        d, shard = self.dims, self.shard
        q, kv, h, i = (
            shard.num_heads * d.head_dim,
            shard.num_kv_heads * d.head_dim,
            d.hidden_size,
            shard.intermediate_size,
        )
        # Live at once inside a layer: the residual stream and its normed copy, q|k|v and the rotated q, k,
        # the attention output, gate|up with silu(gate)*up, and the fp32 temporaries of RMSNorm.
        per_token = dtype_size(self.dtype) * (6 * h + 3 * q + 4 * kv + 4 * i) + 4 * 2 * h
        scratch = attention_scratch(
            shard.num_heads,
            shard.num_kv_heads,
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
        return self.run_layers(self.embed(batch.token_ids), batch, caches)

    def run_layers(
        self, x: torch.Tensor, batch: ForwardBatch, caches: dict[CacheKey, torch.Tensor]
    ) -> torch.Tensor:
        """The decoder stack over input embeddings ``x``: the residual stream before the final norm, which
        :meth:`compute_logits` applies (inside the lm_head GEMM where it can)."""
        delta = None
        for layer in self.layers:
            x, delta = layer(x, delta, batch, caches[layer.layer_index], self.rotary)
        return x if delta is None else x + delta

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        eps = self.dims.rms_norm_eps
        if self.lm_head is None:
            local = ops.linear(ops.rms_norm(hidden, self.norm, eps), self.embed_tokens)
        else:
            local = ops.norm_linear(hidden, None, self.lm_head, eps)[0]
        return gather_logits(local, self.tp, self.dims.vocab_size)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_embed(token_ids, self.embed_tokens, self.tp)
