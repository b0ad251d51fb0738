"""Tiny random Qwen3 checkpoints (registered as the ``qwen3`` tiny architecture): the demo's and the tests'.

Weights are random but scaled so the logits are peaked: greedy decoding then has clear margins, and a
float32 comparison against transformers is decided by the model, not by rounding noise.
"""

from __future__ import annotations

from typing import Any

import torch


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
