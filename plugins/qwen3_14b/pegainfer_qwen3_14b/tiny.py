"""Tiny random Qwen3 checkpoints (registered as the ``qwen3`` tiny architecture): the demo's and the tests'.

Weights are random but scaled so the logits are peaked: greedy decoding then has clear margins, and a
float32 comparison against transformers is decided by the model, not by rounding noise.

Every config value the loader (``Qwen3Dims.from_hf_config``) reads is set to a value that is neither its
default nor transformers' ``Qwen3Config`` default, so a loader that ignored a key fails the logits check
(``tests/test_qwen3_mutations.py`` proves it for each): ``head_dim`` 32 is not hidden / heads (16) nor 128,
``num_key_value_heads`` 2 is not the head count, ``rms_norm_eps`` 1e-5 and ``rope_theta`` 1e6 are not
1e-6 and 1e4, ``max_position_embeddings`` 1024 is not 40960 / 32768. The embeddings are small (std 0.02,
as trained models have), so the first RMSNorm's epsilon moves the logits well past the tolerance; a tied
checkpoint's final norm is scaled up to keep the logits peaked. Left at the defaults, with the reason:
``tie_word_embeddings`` and ``attention_bias`` (false here: the flagship's; true in the variants of
``test_qwen3_vs_hf.py``), the rope type (only "default" is supported) and ``hidden_act`` (silu, the only
one Qwen3 has; the loader does not read it).
"""

from __future__ import annotations

from typing import Any

import torch

EMBED_STD = 0.02


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
        "head_dim": 32,
        "hidden_act": "silu",
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5,
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

    # Small embeddings, as trained models have: the first layer's RMSNorm then depends on its epsilon.
    embed = torch.randn(v, h, generator=gen) * EMBED_STD
    # Tied, the lm_head is the embedding: the final norm's weight makes up its scale (peaked logits).
    final_norm = norm(h) * (0.5 / EMBED_STD if cfg["tie_word_embeddings"] else 1.0)
    tensors = {"model.embed_tokens.weight": embed, "model.norm.weight": final_norm}
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
