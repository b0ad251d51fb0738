"""Qwen3.5 config.json parsing: the text part of the VLM config (or a text-only config), both rope layouts.

Accepted layouts:
- the published VLM file (``model_type`` ``qwen3_5`` / ``qwen3_5_moe``) with the language model's keys
  under ``text_config``; or a flat text-only file (``qwen3_5_text`` / ``qwen3_5_moe_text``);
- rope settings as ``rope_parameters`` (transformers >= 5, ``partial_rotary_factor`` inside it) or as the
  legacy top-level ``rope_theta`` + ``rope_scaling`` + ``partial_rotary_factor``.

``layer_types`` wins over ``full_attention_interval`` (which is only the fallback transformers uses).
For text-only input mRoPE's three position streams are equal, so it is plain partial rotary.

Qwen3-Next (``model_type`` ``qwen3_next``, a flat text config) is the predecessor with the same decoder.
What its config changes: the Gated DeltaNet projections are stored fused and head-grouped
(``in_proj_qkvz`` / ``in_proj_ba``: ``fused_gdn_projections``, de-interleaved at load time); the FFN of a
layer is the sparse MoE block only where ``num_experts > 0``, the layer is not in ``mlp_only_layers`` and
``(i + 1) % decoder_sparse_step == 0`` (a dense MLP of ``intermediate_size`` elsewhere); the router
renormalises its top-k only under ``norm_topk_prob``. Norms, rotary and attention are Qwen3.5's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pegainfer.errors import CheckpointError
from pegainfer.parallel.distributed import TensorParallel

LINEAR = "linear_attention"
FULL = "full_attention"


def text_part(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The language-model section of a (possibly multimodal) config."""
    text = hf_config.get("text_config")
    return text if isinstance(text, dict) else hf_config


class _LinearAttentionWidths:
    """The packed widths of a Gated DeltaNet layer from its head counts (a whole layer's or one rank's)."""

    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim


@dataclass(frozen=True)
class Qwen35Config(_LinearAttentionWidths):
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: tuple[str, ...]
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    # Gated full attention.
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    # Gated DeltaNet.
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    conv_kernel: int
    # Feed-forward: dense (intermediate_size) or MoE (num_experts > 0) in every layer (Qwen3.5), or per
    # layer (Qwen3-Next: the MoE layers are ``moe_layers``, None meaning all of them).
    intermediate_size: int = 0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    moe_layers: tuple[int, ...] | None = None
    norm_topk_prob: bool = True
    # Qwen3-Next's fused, head-grouped GDN projections (``in_proj_qkvz``, ``in_proj_ba``).
    fused_gdn_projections: bool = False
    # Decoder layers of the MTP draft module the config announces (``mtp_num_hidden_layers``; Qwen3-Next's
    # files name it ``num_nextn_predict_layers``); the checkpoint may still lack them.
    num_mtp_layers: int = 0

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and (self.moe_layers is None or layer in self.moe_layers)

    @property
    def is_moe(self) -> bool:
        """Whether any layer's FFN is the sparse MoE block."""
        return any(self.is_moe_layer(i) for i in range(self.num_layers))

    @property
    def has_dense_ffn(self) -> bool:
        """Whether any layer's FFN is the dense MLP."""
        return not all(self.is_moe_layer(i) for i in range(self.num_layers))

    def layers_of(self, kind: str) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == kind]

    @classmethod
    def from_hf_config(cls, hf_config: dict[str, Any]) -> Qwen35Config:
        cfg = text_part(hf_config)

        def need(key: str) -> Any:
            if key not in cfg:
                raise CheckpointError(f"config.json lacks '{key}', which a Qwen3.5 checkpoint must have")
            return cfg[key]

        num_layers = need("num_hidden_layers")
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise CheckpointError(f"config.json: hidden_act '{act}' is not supported (Qwen3.5 uses 'silu')")
        if cfg.get("attention_bias"):
            raise CheckpointError("config.json: attention_bias=true is not supported by the qwen35 plugin")
        next_ = is_qwen3_next(hf_config)
        moe = int(cfg.get("num_experts") or 0)
        moe_layers = _moe_layers(cfg, num_layers, moe) if next_ else None
        dense = not moe or (moe_layers is not None and len(moe_layers) < num_layers)
        num_heads = need("num_attention_heads")
        head_dim = cfg.get("head_dim") or need("hidden_size") // num_heads
        theta, rotary_factor = _rope(cfg)
        tie = cfg.get("tie_word_embeddings", hf_config.get("tie_word_embeddings", False))
        config = cls(
            vocab_size=need("vocab_size"),
            hidden_size=need("hidden_size"),
            num_layers=num_layers,
            layer_types=_layer_types(cfg, num_layers),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(tie),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rotary_dim=int(head_dim * rotary_factor),
            rope_theta=theta,
            linear_num_key_heads=need("linear_num_key_heads"),
            linear_num_value_heads=need("linear_num_value_heads"),
            linear_key_head_dim=need("linear_key_head_dim"),
            linear_value_head_dim=need("linear_value_head_dim"),
            conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
            intermediate_size=need("intermediate_size") if dense else 0,
            num_experts=moe,
            num_experts_per_tok=need("num_experts_per_tok") if moe else 0,
            moe_intermediate_size=need("moe_intermediate_size") if moe else 0,
            shared_expert_intermediate_size=need("shared_expert_intermediate_size") if moe else 0,
            moe_layers=moe_layers,
            # Qwen3.5's router always renormalises; Qwen3-Next's as transformers does (default true).
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)) if next_ else True,
            fused_gdn_projections=next_,
            num_mtp_layers=int(cfg.get("mtp_num_hidden_layers", cfg.get("num_nextn_predict_layers", 0)) or 0),
        )
        config._check()
        return config

    def _check(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(
                f"config.json: num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise CheckpointError(
                f"config.json: linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.linear_num_key_heads})"
            )
        if self.conv_kernel < 2:
            raise CheckpointError(f"config.json: linear_conv_kernel_dim must be >= 2, got {self.conv_kernel}")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise CheckpointError(
                f"config.json: partial_rotary_factor gives a rotary dim of {self.rotary_dim} for head_dim "
                f"{self.head_dim}; it must be even and in (0, head_dim]"
            )
        if self.is_moe and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise CheckpointError(
                f"config.json: num_experts_per_tok ({self.num_experts_per_tok}) must be in [1, num_experts]"
            )


def is_qwen3_next(hf_config: dict[str, Any]) -> bool:
    """Whether the config is Qwen3-Next's (by ``model_type``, else by its architecture)."""
    if "model_type" in hf_config:
        return hf_config["model_type"] == "qwen3_next"
    return "Qwen3NextForCausalLM" in (hf_config.get("architectures") or ())


def _moe_layers(cfg: dict[str, Any], num_layers: int, num_experts: int) -> tuple[int, ...]:
    """Qwen3-Next's sparse layers: not in ``mlp_only_layers`` and every ``decoder_sparse_step``-th."""
    step = int(cfg.get("decoder_sparse_step", 1))
    if step < 1:
        raise CheckpointError(f"config.json: decoder_sparse_step must be >= 1, got {step}")
    dense_only = set(cfg.get("mlp_only_layers") or ())
    bad = sorted(i for i in dense_only if not 0 <= int(i) < num_layers)
    if bad:
        raise CheckpointError(
            f"config.json: mlp_only_layers {bad} are not layers of a {num_layers}-layer model"
        )
    if not num_experts:
        return ()
    return tuple(i for i in range(num_layers) if i not in dense_only and (i + 1) % step == 0)


def _layer_types(cfg: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    types = cfg.get("layer_types")
    if types is None:
        interval = int(cfg.get("full_attention_interval", 4))
        types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(num_layers)]
    if len(types) != num_layers:
        raise CheckpointError(
            f"config.json: layer_types has {len(types)} entries but num_hidden_layers is {num_layers}"
        )
    unknown = sorted({t for t in types if t not in (LINEAR, FULL)})
    if unknown:
        raise CheckpointError(
            f"config.json: unknown layer_types {unknown}; Qwen3.5 has '{LINEAR}' and '{FULL}' layers"
        )
    return tuple(types)


def _rope(cfg: dict[str, Any]) -> tuple[float, float]:
    """(theta, partial_rotary_factor) from ``rope_parameters`` or the legacy top-level keys."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    # "mrope" is the older spelling of the multimodal rope; with text positions it is the default rope.
    if rope_type not in ("default", "mrope"):
        raise CheckpointError(
            f"config.json: rope_type '{rope_type}' is not supported by the qwen35 plugin (only 'default')"
        )
    return float(theta), float(factor)


@dataclass(frozen=True)
class Qwen35Shard(_LinearAttentionWidths):
    """What one tensor-parallel rank holds of each layer (the full counts at tp = 1).

    - gated attention: its query heads (each with its output gate) and its key/value heads, replicated
      over ``tp / num_kv_heads`` consecutive ranks when there are fewer than ranks (``kv_pieces`` distinct
      shards);
    - Gated DeltaNet: its key heads and value heads, both split evenly, so local value head j still reads
      local key head ``j // (Hv / Hk)`` (the GVA mapping of the whole layer, rank by rank);
    - feed-forward: its share of the intermediate features (dense MLP; every routed expert and the shared
      expert under MoE).

    Only the counts of the layer kinds and the FFN the model has are checked (``tp.split``/``tp.heads``
    raise a ConfigError naming the count), before any weight is read.
    """

    num_heads: int
    num_kv_heads: int
    kv_pieces: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    intermediate_size: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int

    @classmethod
    def of(cls, config: Qwen35Config, tp: TensorParallel | None = None) -> Qwen35Shard:
        tp = tp or TensorParallel()
        nq, nkv, kv_pieces = config.num_heads, config.num_kv_heads, config.num_kv_heads
        if config.layers_of(FULL):
            nq = tp.split(config.num_heads, "num_attention_heads")
            nkv, _ = tp.heads(config.num_kv_heads, "num_key_value_heads")
            kv_pieces = min(config.num_kv_heads, tp.size)
        hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
        if config.layers_of(LINEAR):
            hk = tp.split(hk, "linear_num_key_heads")
            hv = tp.split(hv, "linear_num_value_heads")
        inter, ie, is_ = (
            config.intermediate_size,
            config.moe_intermediate_size,
            config.shared_expert_intermediate_size,
        )
        if config.is_moe:
            ie = tp.split(ie, "moe_intermediate_size")
            is_ = tp.split(is_, "shared_expert_intermediate_size")
        if config.has_dense_ffn:
            inter = tp.split(inter, "intermediate_size")
        return cls(
            num_heads=nq,
            num_kv_heads=nkv,
            kv_pieces=kv_pieces,
            linear_num_key_heads=hk,
            linear_num_value_heads=hv,
            linear_key_head_dim=config.linear_key_head_dim,
            linear_value_head_dim=config.linear_value_head_dim,
            intermediate_size=inter,
            moe_intermediate_size=ie,
            shared_expert_intermediate_size=is_,
        )

    @property
    def shared_pieces(self) -> int:
        """How many routed-expert-wide pieces this rank's shared expert is cut into (``moe.SparseMoE``):
        ``ceil(Is / Ie)``, 0 without experts."""
        ie = self.moe_intermediate_size
        return -(-self.shared_expert_intermediate_size // ie) if ie else 0
