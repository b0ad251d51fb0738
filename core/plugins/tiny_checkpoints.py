"""Tiny random checkpoints in the real Hugging Face layout (config.json, safetensors, tokenizer files).

The demo models and the tests build them. Which architectures exist is the plugins' say: each registers
a ``TinyCheckpointBuilder`` (``register_tiny_checkpoints`` hook) that gives the architecture's
config.json and its tensors; this module adds what every checkpoint shares: the tiny byte-level tokenizer,
the vocabulary padded like the published files, the dtype on disk, shards and their index, the legacy or
the new (transformers >= 5) rope layout, and generation_config.json.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from pegainfer.plugins.registry import TinyCheckpointBuilder, tiny_checkpoint_builders
from pegainfer.text.tiny_tokenizer import write_tiny_tokenizer

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _builder(architecture: str) -> TinyCheckpointBuilder:
    builders = tiny_checkpoint_builders()
    if architecture not in builders:
        raise ValueError(
            f"unknown tiny architecture {architecture!r}; the plugins register: {sorted(builders)}"
        )
    return builders[architecture]


def _legacy_rope(config: dict[str, Any]) -> dict[str, Any]:
    config = dict(config)
    params = config.pop("rope_parameters", None) or {}
    config.setdefault("rope_theta", params.get("rope_theta", 10000.0))
    config.setdefault("rope_scaling", None)
    return config


def _new_rope(config: dict[str, Any]) -> dict[str, Any]:
    config = dict(config)
    params = config.get("rope_parameters") or {}
    if params and all(isinstance(v, dict) for v in params.values()):
        return config  # one rope per attention kind, nested: the builder wrote the new layout itself
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


def to_legacy_layout(
    config: dict[str, Any], legacy_rope: Callable[..., dict[str, Any]] | None = None
) -> dict[str, Any]:
    """The layout of the Hub files written before transformers 5: top-level rope keys (``legacy_rope``,
    the builder's own, for a layout the default cannot flatten) and ``torch_dtype``."""
    config = _with_rope_layout(config, legacy_rope or _legacy_rope)
    config["torch_dtype"] = config.pop("dtype")
    return config


def to_new_layout(config: dict[str, Any]) -> dict[str, Any]:
    """transformers >= 5's layout: the rope settings in ``rope_parameters``."""
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
    builder = _builder(architecture)
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer_vocab = write_tiny_tokenizer(folder)
    make_config, make_tensors = builder.load_config(), builder.load_tensors()
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

    if layout == "legacy":
        config = to_legacy_layout(config, builder.load_legacy_rope())
    else:
        config = to_new_layout(config)
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
