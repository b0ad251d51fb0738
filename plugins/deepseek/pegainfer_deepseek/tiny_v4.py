"""Tiny random DeepSeek-V4 checkpoints, in the names transformers' ``save_pretrained`` writes.

Four layers cover every kind V4 has: a sliding-window-only layer, two compressed sparse (CSA, ratio 2,
with a lightning indexer keeping 3 entries) and one heavily compressed (HCA, ratio 8) layer; the first two
MoE layers are hash-routed, the others learned top-k. Three hyper-connection streams, a window of 8
tokens and YaRN on the compress rope, so prompts of a few dozen tokens already slide the window and
close several compressed windows.

Tensor names follow transformers' save-time spelling: DeepSeek's release names under ``model.`` for the
layers (``model.layers.1.attn.compressor.wkv.weight``, ``model.layers.0.ffn.experts.3.w1.weight``), and
``model.embed_tokens.weight``, ``model.norm.weight``, ``model.hc_head.hc_fn``, ``head.weight`` at the top.
``release_names=True`` writes DeepSeek's own release spelling instead (``embed.weight``,
``layers.0.attn.wq_a.weight``, ``hc_head_fn``), which transformers also loads.

Every config value the loader (``DeepseekV4Dims.from_hf_config``) reads is set to a value that is neither its
default nor transformers' ``DeepseekV4Config`` default, so a loader that ignored a key fails the logits check
(``tests/test_deepseek_mutations.py`` proves it for the numeric ones): ``rms_norm_eps`` 1e-5, the main and
compress rope thetas 2e4 / 8e4 (not 1e4 / 1.6e5), ``partial_rotary_factor`` 0.5 (not 0.125, nor the
loader's head_dim / 8), YaRN's ``beta_fast`` 16, ``beta_slow`` 2, ``original_max_position_embeddings`` 512
and ``attention_factor`` 1 (not the derived mscale), ``compress_rates`` 2 / 8 (not 4 / 128),
``hc_mult`` 3, ``hc_sinkhorn_iters`` 3 (not 20), ``hc_eps`` 1e-3, ``routed_scaling_factor`` 2 (not 1.5),
``swiglu_limit`` 2 (not 10: it clips), ``sliding_window`` 8, ``o_groups`` 2, the LoRA ranks, indexer and
expert sizes, and ``layer_types`` / ``mlp_layer_types`` unlike transformers' default patterns. The
embeddings are small (std 0.02, as trained models have), so the first norms' epsilon shows; a tied
checkpoint's final norm is scaled up to keep the logits peaked. Left at the defaults, with the reason:
``truncate`` (transformers' V4 reads it only from the top of ``rope_parameters``, never from the nested
compress rope), ``num_key_value_heads`` 1, ``hidden_act`` silu and ``scoring_func`` sqrtsoftplus (the only
values supported), ``tie_word_embeddings`` false (true in a variant of ``test_deepseek_v4_vs_hf.py``),
``num_nextn_predict_layers`` 0 (the plugin does not serve V4's MTP layers: transformers has no reference); ``n_shared_experts`` and ``norm_topk_prob``
are read by neither the loader nor transformers' V4 model (one shared expert, normalised weights always).
"""

from __future__ import annotations

from typing import Any

import torch

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
EMBED_STD = 0.02


def deepseek_v4_config(vocab_size: int, **overrides: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "partial_rotary_factor": 0.5,
        "q_lora_rank": 48,
        "o_groups": 2,
        "o_lora_rank": 24,
        "sliding_window": 8,
        "layer_types": [SLIDING, CSA, HCA, CSA],
        "compress_rates": {CSA: 2, HCA: 8},
        # 16 indexer heads: an entry scoring exactly 0 (every head's ReLU at 0) is then rare enough that
        # top-k ties, which transformers and we could break differently, do not occur in the tests.
        "index_n_heads": 16,
        "index_head_dim": 16,
        "index_topk": 3,
        "hc_mult": 3,
        "hc_sinkhorn_iters": 3,
        "hc_eps": 1e-3,
        "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe"],
        "moe_intermediate_size": 32,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "scoring_func": "sqrtsoftplus",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.0,
        "swiglu_limit": 2.0,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        # As transformers writes it: the main (sliding layers) and compress (CSA/HCA) ropes nested, with
        # YaRN on the compress one; the legacy layout flattens it into rope_scaling + compress_rope_theta.
        "rope_theta": 20000.0,
        "compress_rope_theta": 80000.0,
        "rope_parameters": {
            "main": {"rope_type": "default", "rope_theta": 20000.0, "partial_rotary_factor": 0.5},
            "compress": {
                "rope_type": "yarn",
                "rope_theta": 80000.0,
                "partial_rotary_factor": 0.5,
                "factor": 4.0,
                "original_max_position_embeddings": 512,
                # With 16 rope channels these give YaRN's ramp [1, 3]; a default in place of one of them
                # (beta_fast 32, beta_slow 1, max_position_embeddings for the original length) gives
                # [0, 3], [1, 4] or [2, 4]: each shows in the logits.
                # ``truncate`` stays unset: transformers' V4 reads it from the top of rope_parameters,
                # not from the nested compress rope, so only its default (true) can match.
                "beta_fast": 16,
                "beta_slow": 2,
                "attention_factor": 1.0,
            },
        },
        "num_nextn_predict_layers": 0,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
    }
    config.update(overrides)
    return config


def _lin(gen: torch.Generator, out: int, inp: int) -> torch.Tensor:
    return torch.randn(out, inp, generator=gen) * inp**-0.5


def _norm(gen: torch.Generator, n: int) -> torch.Tensor:
    return 1.0 + 0.1 * torch.randn(n, generator=gen)


def _hyper_connection(
    gen: torch.Generator, prefix: str, inputs: int, mixes: int, scales: int
) -> dict[str, torch.Tensor]:
    """``fn`` scaled so each mix logit is about unit size after the weightless norm: the streams then mix
    differently per token instead of uniformly."""
    return {
        prefix + "fn": _lin(gen, mixes, inputs),
        prefix + "base": 0.5 * torch.randn(mixes, generator=gen),
        prefix + "scale": 1.0 + 0.2 * torch.randn(scales, generator=gen),
    }


def _compressor(
    gen: torch.Generator, prefix: str, hidden: int, dim: int, ratio: int, coff: int
) -> dict[str, torch.Tensor]:
    return {
        prefix + "wkv.weight": _lin(gen, coff * dim, hidden),
        prefix + "wgate.weight": _lin(gen, coff * dim, hidden),
        prefix + "ape": 0.5 * torch.randn(ratio, coff * dim, generator=gen),
        prefix + "norm.weight": _norm(gen, dim),
    }


def _layer(cfg: dict[str, Any], gen: torch.Generator, index: int) -> dict[str, torch.Tensor]:
    h, nh, d = cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"]
    rq, g, ro, n = cfg["q_lora_rank"], cfg["o_groups"], cfg["o_lora_rank"], cfg["hc_mult"]
    kind, mlp = cfg["layer_types"][index], cfg["mlp_layer_types"][index]
    p = f"layers.{index}."
    a = p + "attn."
    t = {
        p + "attn_norm.weight": _norm(gen, h),
        p + "ffn_norm.weight": _norm(gen, h),
        a + "wq_a.weight": _lin(gen, rq, h),
        a + "q_norm.weight": _norm(gen, rq),
        a + "wq_b.weight": _lin(gen, nh * d, rq),
        a + "wkv.weight": _lin(gen, d, h),
        a + "norm.weight": _norm(gen, d),
        a + "wo_a.weight": _lin(gen, g * ro, nh * d // g),
        a + "wo_b.weight": _lin(gen, h, g * ro),
        a + "attn_sink": 0.5 * torch.randn(nh, generator=gen),
    }
    for site in ("attn", "ffn"):
        t.update(_hyper_connection(gen, f"{p}hc_{site}_", n * h, (2 + n) * n, 3))
    if kind != SLIDING:
        coff = 2 if kind == CSA else 1
        t.update(_compressor(gen, a + "compressor.", h, d, cfg["compress_rates"][kind], coff))
    if kind == CSA:
        ni, di = cfg["index_n_heads"], cfg["index_head_dim"]
        t.update(_compressor(gen, a + "indexer.compressor.", h, di, cfg["compress_rates"][CSA], 2))
        t[a + "indexer.wq_b.weight"] = _lin(gen, ni * di, rq)
        t[a + "indexer.weights_proj.weight"] = _lin(gen, ni, h)
    f = p + "ffn."
    experts, inter, k = cfg["n_routed_experts"], cfg["moe_intermediate_size"], cfg["num_experts_per_tok"]
    t[f + "gate.weight"] = _lin(gen, experts, h)
    if mlp == "hash_moe":
        # Distinct experts per token, as a real hash table has.
        t[f + "gate.tid2eid"] = torch.stack(
            [torch.randperm(experts, generator=gen)[:k] for _ in range(cfg["vocab_size"])]
        )
    else:
        # Large enough next to the scores to change which experts win (it must not enter the weights).
        t[f + "gate.bias"] = 0.2 * torch.randn(experts, generator=gen)
    for e in range(experts):
        t[f"{f}experts.{e}.w1.weight"] = _lin(gen, inter, h)
        t[f"{f}experts.{e}.w2.weight"] = _lin(gen, h, inter)
        t[f"{f}experts.{e}.w3.weight"] = _lin(gen, inter, h)
    t[f + "shared_experts.w1.weight"] = _lin(gen, inter, h)
    t[f + "shared_experts.w2.weight"] = _lin(gen, h, inter)
    t[f + "shared_experts.w3.weight"] = _lin(gen, inter, h)
    return t


def deepseek_v4_tensors(cfg: dict[str, Any], gen: torch.Generator) -> dict[str, torch.Tensor]:
    h, v, n = cfg["hidden_size"], cfg["vocab_size"], cfg["hc_mult"]
    tied = bool(cfg.get("tie_word_embeddings"))
    # Small embeddings, as trained models have: the first norms then depend on their epsilon. Tied, the
    # head is the embedding: the final norm's weight makes up its scale (peaked logits).
    release = {
        "embed.weight": torch.randn(v, h, generator=gen) * EMBED_STD,
        "norm.weight": _norm(gen, h) * (0.5 / EMBED_STD if tied else 1.0),
        **_hyper_connection(gen, "hc_head_", n * h, n, 1),
    }
    for layer in range(cfg["num_hidden_layers"]):
        release.update(_layer(cfg, gen, layer))
    if not tied:
        release["head.weight"] = torch.randn(v, h, generator=gen) * 0.5
    # A builder option, not a config key: popped before config.json is written.
    if cfg.pop("release_names", False):
        return release
    return {_saved_name(name): tensor for name, tensor in release.items()}


def _saved_name(release_name: str) -> str:
    """The spelling transformers' ``save_pretrained`` writes for a release tensor name."""
    top = {
        "embed.weight": "model.embed_tokens.weight",
        "norm.weight": "model.norm.weight",
        "head.weight": "head.weight",
        "hc_head_fn": "model.hc_head.hc_fn",
        "hc_head_base": "model.hc_head.hc_base",
        "hc_head_scale": "model.hc_head.hc_scale",
    }
    return top.get(release_name, "model." + release_name)


def legacy_rope(config: dict[str, Any]) -> dict[str, Any]:
    """The legacy (pre-transformers-5) layout of V4's two ropes: the main one's theta on top, the compress
    one's as ``compress_rope_theta``, its YaRN settings as ``rope_scaling``."""
    config = dict(config)
    params = config.pop("rope_parameters")
    skip = ("rope_theta", "partial_rotary_factor", "attention_factor")
    config["rope_theta"] = params["main"]["rope_theta"]
    config["compress_rope_theta"] = params["compress"]["rope_theta"]
    config["rope_scaling"] = {k: v for k, v in params["compress"].items() if k not in skip}
    return config
