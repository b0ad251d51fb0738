"""Tiny random DeepSeek-V3 checkpoints in the published layout, and their FP8 block-quantized copies.

The config mirrors DeepSeek-V3's config.json at toy size: q and kv LoRA (or a direct ``q_proj`` with
``q_lora_rank=None``), dense first layers then MoE layers with several expert groups, a routing-bias
vector, shared experts, YaRN rope written the legacy way (``"type": "yarn"``) and one MTP layer stored as
``model.layers.{num_hidden_layers}.*``. Weights are scaled so greedy decoding has clear margins.

Every config value the loader (``DeepseekV3Dims.from_hf_config``) reads is set to a value that is neither its
default nor transformers' ``DeepseekV3Config`` default, so a loader that ignored a key fails the logits check
(``tests/test_deepseek_mutations.py`` proves it for each): ``rms_norm_eps`` 2e-6, ``rope_theta`` 5e4,
``routed_scaling_factor`` 1.8 (not 2.5), ``norm_topk_prob`` false, ``n_shared_experts`` 2 (not 1 nor 0),
``first_k_dense_replace`` 1 (not 3), ``n_group`` 4 / ``topk_group`` 2 (not 8 / 4, nor 1 / n_group), the
head dims, LoRA ranks and expert counts, ``max_position_embeddings`` 2048 (not 4096), and every YaRN key:
``original_max_position_embeddings`` 256, ``beta_fast`` 24 / ``beta_slow`` 2 (not 32 / 1), ``mscale`` 0.9
and ``mscale_all_dim`` 0.7 (unequal, so the cos/sin factor is not 1 and the softmax scale has its own
mscale²), ``truncate`` false. The embeddings are small (std 0.02, as trained models have), so the first
RMSNorm's epsilon moves the logits well past the tolerance; a tied checkpoint's final norm is scaled up to
keep the logits peaked. Left at the defaults, with the reason: ``rope_interleave`` true (DeepSeek's pairing;
false in the ``plain-rope-half-split`` variant), ``tie_word_embeddings`` / ``attention_bias`` false (true in
the ``bias-tied`` variant), and ``hidden_act`` silu, ``scoring_func`` sigmoid, ``topk_method`` noaux_tc,
``moe_layer_freq`` 1: the only values the plugin (and transformers' DeepseekV3) implements.

transformers' DeepseekV3 (and V3.2) gives ``q_a_layernorm`` and ``kv_a_layernorm`` a fixed epsilon of 1e-6
and ignores ``rms_norm_eps`` there, while the plugin uses ``rms_norm_eps`` for every norm (as vLLM and
SGLang do). Published configs have 1e-6, where the two agree; at 1e-5 the cached latents would differ by
about 3e-5 (the logits by 1e-5 relative), so the tiny value is 2e-6: the difference stays at rounding level
while a loader that fell back to 1e-6 still moves the first norm (small embeddings) past the tolerance.

``write_fp8_copy`` turns such a checkpoint into the FP8 layout DeepSeek ships: ``float8_e4m3fn`` weights
with a ``weight_scale_inv`` per 128×128 block and a ``quantization_config`` in config.json.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pegainfer_deepseek.fp8 import dequantize_blocks, quantize_blocks

EMBED_STD = 0.02


def deepseek_v3_config(vocab_size: int, **overrides: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 3,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "num_attention_heads": 4,
        "q_lora_rank": 48,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 16,
        "v_head_dim": 24,
        "n_routed_experts": 16,
        "n_shared_experts": 2,
        "num_experts_per_tok": 3,
        "n_group": 4,
        "topk_group": 2,
        "norm_topk_prob": False,
        "routed_scaling_factor": 1.8,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        # Not 1e-6, but close to it: transformers' q_a_layernorm and kv_a_layernorm keep 1e-6 whatever the
        # config says (see the module docstring), and the cached latents are compared within 1e-5.
        "rms_norm_eps": 2e-6,
        "rope_theta": 50000.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 256,
            "beta_fast": 24,
            "beta_slow": 2,
            "mscale": 0.9,
            "mscale_all_dim": 0.7,
            "truncate": False,
        },
        "rope_interleave": True,
        "num_nextn_predict_layers": 1,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
    }
    config.update(overrides)
    # Nominal in MLA (there are no KV heads), but transformers repeats keys by heads / kv_heads: keep equal.
    config.setdefault("num_key_value_heads", config["num_attention_heads"])
    return config


def deepseek_v32_config(vocab_size: int, **overrides: Any) -> dict[str, Any]:
    """DeepSeek-V3.2 at toy size: the V3 config plus the DSA indexer, without an MTP layer. ``index_topk``
    is small so the indexer's selection matters beyond the first few positions."""
    config = deepseek_v3_config(
        vocab_size,
        architectures=["DeepseekV32ForCausalLM"],
        model_type="deepseek_v32",
        num_nextn_predict_layers=0,
        index_n_heads=8,
        index_head_dim=32,
        index_topk=4,
    )
    config.pop("rope_interleave")  # V3.2 always interleaves MLA's rope
    config.update(overrides)
    return config


def deepseek_v32_tensors(cfg: dict[str, Any], gen: torch.Generator) -> dict[str, torch.Tensor]:
    """V3 tensors plus each layer's ``self_attn.indexer.*`` (``weights_proj`` is float32 in the published
    checkpoint; here it takes the checkpoint dtype like the rest)."""
    tensors = deepseek_v3_tensors(cfg, gen)
    h, rq = cfg["hidden_size"], cfg["q_lora_rank"]
    ni, di = cfg["index_n_heads"], cfg["index_head_dim"]
    for layer in range(cfg["num_hidden_layers"] + cfg.get("num_nextn_predict_layers", 0)):
        p = f"model.layers.{layer}.self_attn.indexer."
        tensors[p + "wq_b.weight"] = _lin(gen, ni * di, rq)
        tensors[p + "wk.weight"] = _lin(gen, di, h)
        tensors[p + "k_norm.weight"] = _norm(gen, di)
        tensors[p + "k_norm.bias"] = 0.1 * torch.randn(di, generator=gen)
        tensors[p + "weights_proj.weight"] = _lin(gen, ni, h)
    return tensors


def _lin(gen: torch.Generator, out: int, inp: int) -> torch.Tensor:
    return torch.randn(out, inp, generator=gen) * inp**-0.5


def _norm(gen: torch.Generator, n: int) -> torch.Tensor:
    return 1.0 + 0.1 * torch.randn(n, generator=gen)


def _decoder_layer(
    cfg: dict[str, Any], gen: torch.Generator, prefix: str, moe: bool
) -> dict[str, torch.Tensor]:
    h, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    dn, dr, dv = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    rq, rkv = cfg["q_lora_rank"], cfg["kv_lora_rank"]
    a = prefix + "self_attn."
    t = {prefix + "input_layernorm.weight": _norm(gen, h)}
    if rq is None:
        t[a + "q_proj.weight"] = _lin(gen, nh * (dn + dr), h)
    else:
        t[a + "q_a_proj.weight"] = _lin(gen, rq, h)
        t[a + "q_a_layernorm.weight"] = _norm(gen, rq)
        t[a + "q_b_proj.weight"] = _lin(gen, nh * (dn + dr), rq)
    t[a + "kv_a_proj_with_mqa.weight"] = _lin(gen, rkv + dr, h)
    t[a + "kv_a_layernorm.weight"] = _norm(gen, rkv)
    t[a + "kv_b_proj.weight"] = _lin(gen, nh * (dn + dv), rkv)
    t[a + "o_proj.weight"] = _lin(gen, h, nh * dv)
    if cfg.get("attention_bias"):
        if rq is not None:
            t[a + "q_a_proj.bias"] = 0.1 * torch.randn(rq, generator=gen)
        t[a + "kv_a_proj_with_mqa.bias"] = 0.1 * torch.randn(rkv + dr, generator=gen)
        t[a + "o_proj.bias"] = 0.1 * torch.randn(h, generator=gen)
    t[prefix + "post_attention_layernorm.weight"] = _norm(gen, h)
    m = prefix + "mlp."

    def swiglu(p: str, inter: int) -> None:
        t[p + "gate_proj.weight"] = _lin(gen, inter, h)
        t[p + "up_proj.weight"] = _lin(gen, inter, h)
        t[p + "down_proj.weight"] = _lin(gen, h, inter)

    if not moe:
        swiglu(m, cfg["intermediate_size"])
        return t
    experts, inter = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    t[m + "gate.weight"] = _lin(gen, experts, h)
    # Large enough next to the sigmoid scores to change which experts win, so a bias leaking into the
    # routing weights (it belongs only to the selection) shows in the output.
    t[m + "gate.e_score_correction_bias"] = 0.2 * torch.randn(experts, generator=gen)
    for e in range(experts):
        swiglu(f"{m}experts.{e}.", inter)
    if cfg.get("n_shared_experts"):
        swiglu(m + "shared_experts.", inter * cfg["n_shared_experts"])
    return t


def deepseek_v3_tensors(cfg: dict[str, Any], gen: torch.Generator) -> dict[str, torch.Tensor]:
    h, v, layers = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    first_dense = cfg.get("first_k_dense_replace", 0)
    tied = bool(cfg.get("tie_word_embeddings"))
    # Small embeddings, as trained models have: the first layer's RMSNorm then depends on its epsilon. Tied,
    # the lm_head is the embedding: the final norm's weight makes up its scale (peaked logits).
    tensors = {
        "model.embed_tokens.weight": torch.randn(v, h, generator=gen) * EMBED_STD,
        "model.norm.weight": _norm(gen, h) * (0.5 / EMBED_STD if tied else 1.0),
    }
    for layer in range(layers):
        tensors.update(_decoder_layer(cfg, gen, f"model.layers.{layer}.", moe=layer >= first_dense))
    if not tied:
        tensors["lm_head.weight"] = torch.randn(v, h, generator=gen) * 0.5
    head = tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])
    for k in range(cfg.get("num_nextn_predict_layers", 0)):
        # As published: MTP module k is an extra layer after the main ones, always an MoE layer, with its
        # own copies of the embedding and the output head.
        p = f"model.layers.{layers + k}."
        tensors.update(_decoder_layer(cfg, gen, p, moe=True))
        tensors.update(
            {
                p + "enorm.weight": _norm(gen, h),
                p + "hnorm.weight": _norm(gen, h),
                p + "eh_proj.weight": _lin(gen, h, 2 * h),
                p + "shared_head.norm.weight": _norm(gen, h),
                p + "shared_head.head.weight": head.clone(),
                p + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
            }
        )
    return tensors


# ---------------------------------------------------------------------------------------------- FP8 copies


def fp8_quantized(name: str, tensor: torch.Tensor) -> bool:
    """Whether DeepSeek ships ``name`` in FP8: the 2-D projections inside decoder layers, except the
    router, the MTP projection ``eh_proj`` and the MTP copies of embedding and head (those stay bf16)."""
    if tensor.dim() != 2 or not name.startswith("model.layers.") or not name.endswith(".weight"):
        return False
    excluded = ("mlp.gate.weight", "eh_proj.weight", "embed_tokens.weight", "shared_head.head.weight")
    return not name.endswith(excluded)


#: A tiny DeepSeek-V3 shape whose FP8 blocks (128x128) and tensor-parallel shards do not line up: its
#: projections are wider than one block but not a multiple of it.
UNALIGNED_SHAPE = {
    "hidden_size": 160,
    "intermediate_size": 288,
    "moe_intermediate_size": 48,
    "q_lora_rank": 144,
    "kv_lora_rank": 136,
    "num_hidden_layers": 2,
}


def write_fp8_copy(
    source: str | Path,
    destination: str | Path,
    *,
    block_size: tuple[int, int] = (128, 128),
    dequantized: bool = False,
) -> Path:
    """Copy the checkpoint in ``source`` with its projections block-quantized to FP8, as DeepSeek ships V3.

    With ``dequantized=True`` the copy instead holds the dequantized values (float32, no scales, no
    ``quantization_config``): the same model as the FP8 copy in plain weights, a reference for it.
    """
    source, destination = Path(source), Path(destination)
    destination.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(source.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                tensors[name] = f.get_tensor(name)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if not fp8_quantized(name, tensor):
            out[name] = tensor
            continue
        q, scale_inv = quantize_blocks(tensor, block_size)
        if dequantized:
            out[name] = dequantize_blocks(q, scale_inv, block_size).to(tensor.dtype)
        else:
            out[name] = q
            out[name + "_scale_inv"] = scale_inv
    save_file({k: t.contiguous() for k, t in out.items()}, str(destination / "model.safetensors"))
    for path in source.iterdir():
        if path.is_file() and not path.name.startswith("model.safetensors") and path.suffix != ".safetensors":
            shutil.copy(path, destination / path.name)
    config = json.loads((source / "config.json").read_text())
    if not dequantized:
        config["quantization_config"] = {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": list(block_size),
        }
    (destination / "config.json").write_text(json.dumps(config, indent=2))
    return destination
