"""Tiny random checkpoints in the real Hugging Face layout (config.json, safetensors, tokenizer files).

Weights are random but scaled so the logits are peaked: greedy decoding then has clear margins, and a
float32 comparison against transformers is decided by the model, not by rounding noise.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from pegainfer.tiny_tokenizer import write_tiny_tokenizer

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def qwen3_config(vocab_size: int, **overrides: Any) -> dict[str, Any]:
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "initializer_range": 0.02,
    }
    config.update(overrides)
    return config


def qwen3_tensors(cfg: dict[str, Any], gen: torch.Generator) -> dict[str, torch.Tensor]:
    h, i, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    nq, nkv, v = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]

    def lin(out: int, inp: int) -> torch.Tensor:
        return torch.randn(out, inp, generator=gen) * inp**-0.5

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=gen)

    tensors = {"model.embed_tokens.weight": torch.randn(v, h, generator=gen), "model.norm.weight": norm(h)}
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        tensors.update(
            {
                p + "input_layernorm.weight": norm(h),
                p + "self_attn.q_proj.weight": lin(nq * d, h),
                p + "self_attn.k_proj.weight": lin(nkv * d, h),
                p + "self_attn.v_proj.weight": lin(nkv * d, h),
                p + "self_attn.q_norm.weight": norm(d),
                p + "self_attn.k_norm.weight": norm(d),
                p + "self_attn.o_proj.weight": lin(h, nq * d),
                p + "post_attention_layernorm.weight": norm(h),
                p + "mlp.gate_proj.weight": lin(i, h),
                p + "mlp.up_proj.weight": lin(i, h),
                p + "mlp.down_proj.weight": lin(h, i),
            }
        )
        if cfg.get("attention_bias"):
            for name, n in (("q", nq * d), ("k", nkv * d), ("v", nkv * d)):
                tensors[p + f"self_attn.{name}_proj.bias"] = 0.1 * torch.randn(n, generator=gen)
    if not cfg["tie_word_embeddings"]:
        tensors["lm_head.weight"] = torch.randn(v, h, generator=gen) * 0.5
    return tensors


# architecture name -> "module" providing ``config(vocab_size, **overrides)`` and ``tensors(config, gen)``;
# modules other than this one are imported on first use.
ARCHITECTURES: dict[str, str] = {
    "qwen3": __name__,
    "qwen3_5": "pegainfer.testing.tiny_qwen35",
    "qwen3_5_moe": "pegainfer.testing.tiny_qwen35",
    "deepseek_v3": "pegainfer.testing.tiny_deepseek",
    "deepseek_v32": "pegainfer.testing.tiny_deepseek",
    "deepseek_v4": "pegainfer.testing.tiny_deepseek_v4",
}


def _builders(
    architecture: str,
) -> tuple[Callable[..., dict[str, Any]], Callable[..., dict[str, torch.Tensor]]]:
    if architecture == "qwen3":
        return qwen3_config, qwen3_tensors
    module = importlib.import_module(ARCHITECTURES[architecture])
    return getattr(module, f"{architecture}_config"), getattr(module, f"{architecture}_tensors")


def _legacy_rope(config: dict[str, Any]) -> dict[str, Any]:
    config = dict(config)
    params = config.pop("rope_parameters", None) or {}
    if "compress" in params:  # DeepSeek-V4's two ropes: a plain main one, the scaling on the compress one
        skip = ("rope_theta", "partial_rotary_factor", "attention_factor")
        config["rope_theta"] = params["main"]["rope_theta"]
        config["compress_rope_theta"] = params["compress"]["rope_theta"]
        config["rope_scaling"] = {k: v for k, v in params["compress"].items() if k not in skip}
        return config
    config.setdefault("rope_theta", params.get("rope_theta", 10000.0))
    config.setdefault("rope_scaling", None)
    return config


def _new_rope(config: dict[str, Any]) -> dict[str, Any]:
    config = dict(config)
    if "compress" in (config.get("rope_parameters") or {}):
        return config  # DeepSeek-V4 nests its two ropes; the builder already wrote them that way
    theta = config.pop("rope_theta", 10000.0)
    scaling = config.pop("rope_scaling", None) or {"rope_type": "default"}
    config["rope_parameters"] = {**scaling, "rope_theta": theta}
    # transformers >= 5 keeps the partial rotary factor inside rope_parameters.
    if "partial_rotary_factor" in config:
        config["rope_parameters"]["partial_rotary_factor"] = config.pop("partial_rotary_factor")
    return config


def _with_rope_layout(config: dict[str, Any], convert: Callable[..., dict[str, Any]]) -> dict[str, Any]:
    """Rope keys live in the language-model part: ``text_config`` for multimodal configs, else the top."""
    if "text_config" in config:
        return {**config, "text_config": convert(config["text_config"])}
    return convert(config)


def _to_legacy_layout(config: dict[str, Any]) -> dict[str, Any]:
    """The layout of the Hub files written before transformers 5: top-level rope keys and ``torch_dtype``."""
    config = _with_rope_layout(config, _legacy_rope)
    config["torch_dtype"] = config.pop("dtype")
    return config


def _to_new_layout(config: dict[str, Any]) -> dict[str, Any]:
    return _with_rope_layout(config, _new_rope)


def write_tiny_checkpoint(
    directory: str | Path,
    architecture: str = "qwen3",
    *,
    seed: int = 0,
    dtype: str = "float32",
    layout: str = "new",
    num_shards: int = 1,
    write_index: bool = True,
    **config_overrides: Any,
) -> Path:
    """Write a random checkpoint of ``architecture`` with a real small tokenizer; returns the folder.

    ``layout`` is "new" (``rope_parameters``, ``dtype``) or "legacy" (``rope_theta``/``rope_scaling``,
    ``torch_dtype``); ``num_shards > 1`` splits the weights over several files, indexed by
    ``model.safetensors.index.json`` unless ``write_index`` is False.
    """
    if architecture not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {architecture!r}; known: {sorted(ARCHITECTURES)}")
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer_vocab = write_tiny_tokenizer(folder)
    make_config, make_tensors = _builders(architecture)
    # Padded like the published checkpoints, unless a test asks for a size of its own.
    vocab = config_overrides.pop("vocab_size", -(-tokenizer_vocab // 64) * 64)
    config = make_config(vocab, **config_overrides)
    config["dtype"] = dtype
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    vocab_map = json.loads((folder / "tokenizer.json").read_text())["added_tokens"]
    ids = {t["content"]: t["id"] for t in vocab_map}
    eos = ids[tokenizer_config["eos_token"]]
    config.setdefault("bos_token_id", ids.get("<|endoftext|>"))
    config.setdefault("eos_token_id", eos)
    if "text_config" in config:
        config["text_config"].setdefault("bos_token_id", config["bos_token_id"])
        config["text_config"].setdefault("eos_token_id", eos)

    gen = torch.Generator().manual_seed(seed)
    tensors = {k: t.to(_DTYPES[dtype]).contiguous() for k, t in make_tensors(config, gen).items()}
    names = sorted(tensors)
    if num_shards == 1:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        weight_map = dict.fromkeys(names, "model.safetensors")
    else:
        weight_map = {}
        for shard in range(num_shards):
            file = f"model-{shard + 1:05d}-of-{num_shards:05d}.safetensors"
            part = {n: tensors[n] for n in names[shard::num_shards]}
            save_file(part, str(folder / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(part, file))
    if num_shards > 1 and write_index:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))

    config = _to_legacy_layout(config) if layout == "legacy" else _to_new_layout(config)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    generation = {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": [eos, ids["<|endoftext|>"]],
        "do_sample": True,
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
    }
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return folder
