"""The toy's tiny random checkpoint (the ``toy_qwen3`` tiny architecture) and its embedded demo.

Qwen3's tensor layout under the toy's labels. The config departs from transformers' Qwen3 defaults
(``rms_norm_eps``, ``rope_theta``, a ``head_dim`` other than hidden / heads), so a loader that ignored
one of them would not match transformers. The embeddings are small, as a trained model's are, so the
first RMSNorm's eps is not lost in rounding; the other matrices are scaled so the logits are peaked and
greedy decoding has clear margins.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pegainfer.plugins.tiny_checkpoints import write_tiny_checkpoint


def toy_qwen3_config(vocab_size: int, **overrides: Any) -> dict[str, Any]:
    config = {
        "architectures": ["ToyQwen3ForCausalLM"],
        "model_type": "toy_qwen3",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "hidden_act": "silu",
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "rope_theta": 2500.0,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "initializer_range": 0.02,
    }
    config.update(overrides)
    return config


def toy_qwen3_tensors(cfg: dict[str, Any], gen: torch.Generator) -> dict[str, torch.Tensor]:
    h, i, d, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d

    def matrix(rows: int, cols: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen) * scale * cols**-0.5

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=gen)

    tensors = {
        "model.embed_tokens.weight": 0.02 * torch.randn(v, h, generator=gen),
        "model.norm.weight": norm(h),
    }
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        tensors |= {
            p + "input_layernorm.weight": norm(h),
            p + "self_attn.q_proj.weight": matrix(q, h),
            p + "self_attn.k_proj.weight": matrix(kv, h),
            p + "self_attn.v_proj.weight": matrix(kv, h),
            p + "self_attn.q_norm.weight": norm(d),
            p + "self_attn.k_norm.weight": norm(d),
            p + "self_attn.o_proj.weight": matrix(h, q),
            p + "post_attention_layernorm.weight": norm(h),
            p + "mlp.gate_proj.weight": matrix(i, h),
            p + "mlp.up_proj.weight": matrix(i, h),
            p + "mlp.down_proj.weight": matrix(h, i),
        }
    if not cfg["tie_word_embeddings"]:
        tensors["lm_head.weight"] = matrix(v, h, scale=4.0)
    return tensors


def write_demo_checkpoint(folder: Path) -> None:
    """``model=toy_qwen3`` without ``model.path`` runs this one."""
    write_tiny_checkpoint(folder, "toy_qwen3", seed=7)
