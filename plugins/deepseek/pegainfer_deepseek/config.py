"""DeepSeek-V3 config.json, in either layout, parsed into the dimensions the model is built from.

Two layouts exist: the Hub files (top-level ``rope_theta`` and ``rope_scaling: {"type": "yarn", ...}``,
``torch_dtype``) and transformers >= 5 (``rope_parameters: {"rope_type": ..., "rope_theta": ...}``).
Defaults for absent keys are transformers' ``DeepseekV3Config`` defaults, so a sparse config means the
same model here as there.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import StrictBool

from pegainfer.config.schema import ModelConfig
from pegainfer.errors import CheckpointError
from pegainfer.layers.rotary_yarn import YarnScaling


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str  # "default" or "yarn"
    yarn: YarnScaling | None
    interleaved: bool


@dataclass(frozen=True)
class Fp8Config:
    """DeepSeek's block FP8: ``weight`` in float8_e4m3fn, ``weight_scale_inv`` per ``block`` of it."""

    block: tuple[int, int]


@dataclass(frozen=True)
class IndexerConfig:
    """DeepSeek-V3.2's DSA lightning indexer: ``n_heads`` query heads of ``head_dim`` scoring every cached
    position, of which the ``topk`` best (per query token) are the only keys MLA attends to."""

    n_heads: int
    head_dim: int
    topk: int


@dataclass(frozen=True)
class DeepseekV3Dims:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_layers: int
    first_k_dense_replace: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    rms_norm_eps: float
    rope: RopeConfig
    attention_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    num_mtp_layers: int
    fp8: Fp8Config | None
    indexer: IndexerConfig | None = None  # set for DeepSeek-V3.2 (every layer has one)
    #: ``model.quantization=fp8`` on a checkpoint that is not FP8: the routed experts and the projections
    #: of attention and the dense feed-forwards are quantized to block FP8 (``QUANTIZE_BLOCK``) at load.
    quantize_at_load: bool = False
    #: The block-FP8 weights' GEMMs (projections and routed experts) quantize their input activations per
    #: token and 128 columns (W8A8): ``model.fp8_activations``.
    fp8_activations: bool = False

    @property
    def fp8_block(self) -> tuple[int, int] | None:
        """The (rows, columns) tile of the weights kept in block FP8: the checkpoint's, or the one they are
        quantized to at load; None for a model kept in its dtype."""
        if self.fp8 is not None:
            return self.fp8.block
        return QUANTIZE_BLOCK if self.quantize_at_load else None

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, layer_index: int) -> bool:
        """Layers ``[0, first_k_dense_replace)`` are dense; later ones, MTP layers included, are MoE."""
        return layer_index >= self.first_k_dense_replace

    @property
    def softmax_scale(self) -> float:
        """``qk_head_dim^-0.5``, times YaRN's ``mscale²`` when scaled with ``mscale_all_dim`` set."""
        scale = self.qk_head_dim**-0.5
        if self.rope.yarn is not None:
            scale *= self.rope.yarn.softmax_scale_factor()
        return scale

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> DeepseekV3Dims:
        need = functools.partial(required_key, cfg, family="DeepSeek-V3")

        _check_supported(cfg)
        indexer = parse_indexer(cfg)
        experts = int(cfg.get("n_routed_experts", 256))
        n_group = int(cfg.get("n_group") or 1)
        topk_group = int(cfg.get("topk_group") or n_group)
        dims = cls(
            vocab_size=need("vocab_size"),
            hidden_size=need("hidden_size"),
            intermediate_size=need("intermediate_size"),
            moe_intermediate_size=int(cfg.get("moe_intermediate_size", 2048)),
            num_layers=need("num_hidden_layers"),
            first_k_dense_replace=int(cfg.get("first_k_dense_replace", 3)),
            num_heads=need("num_attention_heads"),
            q_lora_rank=cfg.get("q_lora_rank", 1536),
            kv_lora_rank=need("kv_lora_rank"),
            qk_nope_head_dim=need("qk_nope_head_dim"),
            qk_rope_head_dim=need("qk_rope_head_dim"),
            v_head_dim=need("v_head_dim"),
            n_routed_experts=experts,
            n_shared_experts=int(cfg.get("n_shared_experts") or 0),
            num_experts_per_tok=int(cfg.get("num_experts_per_tok", 8)),
            n_group=n_group,
            topk_group=topk_group,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 2.5)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=parse_rope(cfg, force_interleaved=indexer is not None),
            attention_bias=bool(cfg.get("attention_bias", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            num_mtp_layers=int(cfg.get("num_nextn_predict_layers", cfg.get("num_mtp_layers", 0)) or 0),
            fp8=parse_quantization(cfg.get("quantization_config")),
            indexer=indexer,
        )
        if experts % n_group or not 0 < topk_group <= n_group:
            raise CheckpointError(
                f"config.json: n_routed_experts ({experts}) must split into n_group ({n_group}) equal groups "
                f"and topk_group ({topk_group}) must be in [1, n_group]"
            )
        if dims.num_experts_per_tok > topk_group * (experts // n_group):
            raise CheckpointError(
                f"config.json: num_experts_per_tok ({dims.num_experts_per_tok}) exceeds the experts of the "
                f"topk_group ({topk_group}) selected groups"
            )
        if indexer is not None:
            _check_v32(cfg, dims)
        return dims


def is_v32(cfg: dict[str, Any]) -> bool:
    return cfg.get("model_type") == "deepseek_v32" or "index_topk" in cfg


def parse_indexer(cfg: dict[str, Any]) -> IndexerConfig | None:
    """The DSA indexer of a V3.2 config (transformers' ``DeepseekV32Config`` defaults), None for V3."""
    if not is_v32(cfg):
        return None
    indexer = IndexerConfig(
        n_heads=int(cfg.get("index_n_heads") or 64),
        head_dim=int(cfg.get("index_head_dim") or 128),
        topk=int(cfg.get("index_topk") or 2048),
    )
    if min(indexer.n_heads, indexer.head_dim, indexer.topk) <= 0:
        raise CheckpointError(f"config.json: invalid DSA indexer settings {indexer}")
    return indexer


def _check_v32(cfg: dict[str, Any], dims: DeepseekV3Dims) -> None:
    """V3.2's indexer reads MLA's ``q_a_layernorm`` output and ropes its first ``qk_rope_head_dim``
    channels; its MLP pattern must be the first-k-dense one the decoder builds."""
    assert dims.indexer is not None
    if dims.q_lora_rank is None:
        raise CheckpointError(
            "config.json: DeepSeek-V3.2 needs q_lora_rank (the DSA indexer reads the q LoRA)"
        )
    if dims.qk_rope_head_dim > dims.indexer.head_dim:
        raise CheckpointError(
            f"config.json: qk_rope_head_dim ({dims.qk_rope_head_dim}) exceeds index_head_dim "
            f"({dims.indexer.head_dim})"
        )
    types = cfg.get("mlp_layer_types")
    if types is not None:
        expected = [
            "dense" if layer < dims.first_k_dense_replace else "sparse" for layer in range(dims.num_layers)
        ]
        if list(types) != expected:
            raise CheckpointError(
                f"config.json: mlp_layer_types {types!r} is not supported (the DeepSeek plugin builds "
                f"first_k_dense_replace={dims.first_k_dense_replace} dense layers, then MoE: {expected!r})"
            )


def _check_supported(cfg: dict[str, Any]) -> None:
    """Reject settings whose math this plugin (and transformers' DeepseekV3) does not implement, rather
    than run a different model than the checkpoint describes."""
    rules = {
        "hidden_act": ("silu",),
        "scoring_func": ("sigmoid",),
        "topk_method": ("noaux_tc",),
        "moe_layer_freq": (1,),
    }
    for key, allowed in rules.items():
        if key in cfg and cfg[key] not in allowed:
            raise CheckpointError(
                f"config.json: {key}={cfg[key]!r} is not supported by the DeepSeek-V3 plugin (expected "
                f"{' or '.join(map(repr, allowed))})"
            )


def required_key(cfg: dict[str, Any], key: str, *, family: str) -> Any:
    """``cfg[key]``; a CheckpointError naming the key when it is missing or null."""
    if cfg.get(key) is None:
        raise CheckpointError(f"config.json lacks '{key}', which a {family} checkpoint must have")
    return cfg[key]


def parse_rope(cfg: dict[str, Any], *, force_interleaved: bool = False) -> RopeConfig:
    """Theta and scaling from ``rope_parameters`` (new) or ``rope_theta`` + ``rope_scaling`` (legacy).

    ``force_interleaved``: V3.2's MLA always uses interleaved rope (transformers ignores
    ``rope_interleave`` there)."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = merged.get("rope_type") or merged.get("type") or "default"
    interleaved = force_interleaved or bool(cfg.get("rope_interleave", True))
    if rope_type == "default":
        return RopeConfig(theta, "default", None, interleaved)
    if rope_type != "yarn":
        raise CheckpointError(
            f"config.json: rope type {rope_type!r} is not supported by the DeepSeek-V3 plugin "
            "('default' or 'yarn')"
        )
    if "factor" not in merged:
        raise CheckpointError("config.json: a 'yarn' rope scaling needs 'factor'")
    yarn = YarnScaling.from_params(
        merged, cfg.get("max_position_embeddings", 4096), merged.get("attention_factor")
    )
    return RopeConfig(theta, "yarn", yarn, interleaved)


def parse_quantization(qc: dict[str, Any] | None) -> Fp8Config | None:
    if not qc:
        return None
    method = qc.get("quant_method")
    block = qc.get("weight_block_size")
    if method != "fp8" or not (isinstance(block, list) and len(block) == 2):
        raise CheckpointError(
            f"config.json: quantization_config {qc!r} is not supported; the DeepSeek plugin reads block FP8 "
            "('quant_method': 'fp8' with a two-element 'weight_block_size')"
        )
    if qc.get("fmt", "e4m3") != "e4m3":
        raise CheckpointError(f"config.json: FP8 format {qc.get('fmt')!r} is not supported (only 'e4m3')")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise CheckpointError(
            f"config.json: FP8 activation_scheme {qc.get('activation_scheme')!r} is not supported (only "
            "'dynamic': activations quantized per token and tile as they run)"
        )
    return Fp8Config((int(block[0]), int(block[1])))


#: The tile of experts quantized at load (``model.quantization=fp8``): DeepSeek's own.
QUANTIZE_BLOCK = (128, 128)


class DeepseekModelConfig(ModelConfig):
    """The ``model.*`` keys of ``model=deepseek``: pegainfer's ModelConfig plus ``quantization``.

    ``quantization=fp8``: a checkpoint that is not FP8 has its routed experts and the projections of
    attention and of the dense and shared feed-forwards quantized to block FP8 (128×128 tiles, one scale
    each) at load, as DeepSeek ships its FP8 checkpoints, so they take half of bf16's memory and bytes a
    step (the accuracy cost is measured in ``tests/test_deepseek_fp8.py``). FP8 checkpoints are FP8
    anyway."""

    quantization: Literal["fp8"] | None = None
    #: ``true``: block-FP8 weights (projections and routed experts) have their GEMMs' inputs quantized per
    #: token and 128-column group as they run (W8A8, the FP8 tensor cores): what DeepSeek's checkpoints
    #: declare (``activation_scheme: dynamic``), how the model was trained, and how vLLM and SGLang serve
    #: it. ``false`` (the default until W8A8 measures faster here: see docs/benchmarks.md) keeps them
    #: 16-bit (W8A16: the dequantized model's outputs to the bf16 GEMM's rounding).
    fp8_activations: StrictBool = False
