"""DeepSeek-V4 config.json parsed into the dimensions the model is built from.

Defaults for absent keys are transformers' ``DeepseekV4Config`` defaults, and the legacy spellings it folds
in are read too (``compress_ratios`` per layer, ``compress_rate_csa`` / ``compress_rate_hca``,
``num_hash_layers``, ``qk_rope_head_dim``, a flat ``rope_parameters`` / ``rope_scaling``), so a sparse or
old config means the same model here as there.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from pegainfer.errors import CheckpointError
from pegainfer.layers.rotary_yarn import YarnScaling
from pegainfer_deepseek.config import Fp8Config, parse_quantization, required_key

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"  # compressed entries chosen per query by a lightning indexer
HCA = "heavily_compressed_attention"  # every compressed entry visible
LAYER_KINDS = (SLIDING, CSA, HCA)
_RATIO_TO_KIND = {0: SLIDING, 4: CSA, 128: HCA}
_DEFAULT_RATES = {CSA: 4, HCA: 128}
MLP_KINDS = ("hash_moe", "moe")


@dataclass(frozen=True)
class V4Rope:
    """One of V4's two ropes: ``main`` (sliding layers) or ``compress`` (CSA/HCA layers and compressors)."""

    theta: float
    yarn: YarnScaling | None


@dataclass(frozen=True)
class DeepseekV4Dims:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_dim: int  # the trailing channels of each head that are roped
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    layer_kinds: tuple[str, ...]
    compress_rates: dict[str, int]
    main_rope: V4Rope
    compress_rope: V4Rope
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    mlp_kinds: tuple[str, ...]
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    routed_scaling_factor: float
    swiglu_limit: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    fp8: Fp8Config | None

    def ratio(self, layer_index: int) -> int:
        """Tokens per compressed entry of the layer (0 for a sliding-only layer)."""
        kind = self.layer_kinds[layer_index]
        return 0 if kind == SLIDING else self.compress_rates[kind]

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> DeepseekV4Dims:
        need = functools.partial(required_key, cfg, family="DeepSeek-V4")

        for key, allowed in (("hidden_act", "silu"), ("scoring_func", "sqrtsoftplus")):
            if cfg.get(key, allowed) != allowed:
                raise CheckpointError(
                    f"config.json: {key}={cfg[key]!r} is not supported by the DeepSeek-V4 plugin "
                    f"(expected {allowed!r})"
                )
        if cfg.get("num_key_value_heads", 1) != 1:
            raise CheckpointError("config.json: DeepSeek-V4 attention has one shared KV head")
        layers = int(need("num_hidden_layers"))
        head_dim = int(cfg.get("head_dim", 512))
        factor = cfg.get("partial_rotary_factor")
        if factor is None:  # transformers' default factor is 64 / 512
            rope_dim = int(cfg.get("qk_rope_head_dim", head_dim // 8))
        else:
            rope_dim = int(head_dim * float(factor))
        rates = {**_DEFAULT_RATES, **(cfg.get("compress_rates") or {})}
        rates[CSA] = int(cfg.get("compress_rate_csa", rates[CSA]))
        rates[HCA] = int(cfg.get("compress_rate_hca", rates[HCA]))
        main, compress = _parse_ropes(cfg)
        quantization = cfg.get("quantization_config") or {}
        if quantization.get("expert_dtype", cfg.get("expert_dtype", "fp8")) not in ("fp8", "bf16"):
            raise CheckpointError(
                "config.json: FP4-packed experts (expert_dtype 'fp4') are not supported by the DeepSeek-V4 "
                "plugin; use a checkpoint with FP8 or BF16 experts"
            )
        dims = cls(
            vocab_size=int(need("vocab_size")),
            hidden_size=int(need("hidden_size")),
            num_layers=layers,
            num_heads=int(need("num_attention_heads")),
            head_dim=head_dim,
            rope_dim=rope_dim,
            q_lora_rank=int(cfg.get("q_lora_rank", 1024)),
            o_groups=int(cfg.get("o_groups", 8)),
            o_lora_rank=int(cfg.get("o_lora_rank", 1024)),
            sliding_window=int(cfg.get("sliding_window", 128)),
            layer_kinds=_layer_kinds(cfg, layers),
            compress_rates=rates,
            main_rope=main,
            compress_rope=compress,
            index_n_heads=int(cfg.get("index_n_heads", 64)),
            index_head_dim=int(cfg.get("index_head_dim", 128)),
            index_topk=int(cfg.get("index_topk", 512)),
            hc_mult=int(cfg.get("hc_mult", 4)),
            hc_sinkhorn_iters=int(cfg.get("hc_sinkhorn_iters", 20)),
            hc_eps=float(cfg.get("hc_eps", 1e-6)),
            mlp_kinds=_mlp_kinds(cfg, layers),
            moe_intermediate_size=int(cfg.get("moe_intermediate_size", 2048)),
            n_routed_experts=int(cfg.get("n_routed_experts", 256)),
            num_experts_per_tok=int(cfg.get("num_experts_per_tok", 6)),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.5)),
            swiglu_limit=float(cfg.get("swiglu_limit", 10.0)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            fp8=parse_quantization(cfg.get("quantization_config")),
        )
        _check(dims)
        return dims


def _layer_kinds(cfg: dict[str, Any], layers: int) -> tuple[str, ...]:
    kinds = cfg.get("layer_types")
    if kinds is None and cfg.get("compress_ratios") is not None:
        try:
            kinds = [_RATIO_TO_KIND[int(r)] for r in cfg["compress_ratios"]]
        except KeyError as exc:
            raise CheckpointError(f"config.json: compress_ratios has an unknown ratio {exc}") from None
    if kinds is None:  # transformers' default: two HCA layers, then CSA and HCA alternating
        kinds = [HCA] * min(layers, 2) + [CSA if i % 2 else HCA for i in range(max(layers - 2, 0))]
    kinds = list(kinds)[:layers]
    if len(kinds) != layers or any(k not in LAYER_KINDS for k in kinds):
        raise CheckpointError(
            f"config.json: layer_types must name one of {LAYER_KINDS} per layer ({layers}); got {kinds}"
        )
    return tuple(kinds)


def _mlp_kinds(cfg: dict[str, Any], layers: int) -> tuple[str, ...]:
    kinds = cfg.get("mlp_layer_types")
    if kinds is None:
        hashed = int(cfg.get("num_hash_layers", 3))
        kinds = ["hash_moe"] * min(layers, hashed) + ["moe"] * max(0, layers - hashed)
    kinds = list(kinds)[:layers]
    if len(kinds) != layers or any(k not in MLP_KINDS for k in kinds):
        raise CheckpointError(
            f"config.json: mlp_layer_types must name one of {MLP_KINDS} per layer ({layers}); got {kinds}"
        )
    return tuple(kinds)


def _parse_ropes(cfg: dict[str, Any]) -> tuple[V4Rope, V4Rope]:
    """``rope_parameters`` nested as ``{"main": ..., "compress": ...}`` (transformers writes that), or flat
    scaling keys for the compress rope (``rope_parameters`` or legacy ``rope_scaling``): the main rope is
    then plain at ``rope_theta`` and the compress rope at ``compress_rope_theta``, with YaRN's cos/sin
    factor forced to 1 as transformers does."""
    params = dict(cfg.get("rope_parameters") or {})
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        return _rope(params["main"], cfg, None), _rope(params["compress"], cfg, None)
    flat = {**(cfg.get("rope_scaling") or {}), **params}
    main = V4Rope(float(cfg.get("rope_theta", 10000.0)), None)
    compress = {**flat, "rope_theta": float(cfg.get("compress_rope_theta", 160000.0))}
    return main, _rope(compress, cfg, 1.0)


def _rope(params: dict[str, Any], cfg: dict[str, Any], yarn_attention_factor: float | None) -> V4Rope:
    theta = float(params.get("rope_theta", 10000.0))
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind == "default":
        return V4Rope(theta, None)
    if kind != "yarn" or "factor" not in params:
        raise CheckpointError(
            f"config.json: rope {params!r} is not supported by the DeepSeek-V4 plugin ('default', or 'yarn' "
            "with a 'factor')"
        )
    attention_factor = params.get("attention_factor", yarn_attention_factor)
    yarn = YarnScaling.from_params(
        params,
        cfg.get("max_position_embeddings", 1048576),
        None if attention_factor is None else float(attention_factor),
    )
    return V4Rope(theta, yarn)


def _check(dims: DeepseekV4Dims) -> None:
    problems = []
    if dims.rope_dim % 2 or not 0 < dims.rope_dim <= min(dims.head_dim, dims.index_head_dim):
        problems.append(f"the rope dim ({dims.rope_dim}) must be even and fit head_dim and index_head_dim")
    if (dims.num_heads * dims.head_dim) % dims.o_groups:
        problems.append(f"o_groups ({dims.o_groups}) must divide num_attention_heads * head_dim")
    if dims.num_experts_per_tok > dims.n_routed_experts:
        problems.append("num_experts_per_tok exceeds n_routed_experts")
    if min(dims.sliding_window, dims.hc_mult, dims.hc_sinkhorn_iters, *dims.compress_rates.values()) < 1:
        problems.append("sliding_window, hc_mult, hc_sinkhorn_iters and the compress rates must be positive")
    if problems:
        raise CheckpointError("config.json: " + "; ".join(problems))
