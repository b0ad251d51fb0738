"""Tiny random Qwen3.5 checkpoints (dense and MoE) in the layouts the Hub files use.

The default is the published VLM layout: ``architectures: ["Qwen3_5ForConditionalGeneration"]``, the
language model's keys nested under ``text_config``, its weights under ``model.language_model.``, plus a
small vision tower (``model.visual.*``) that a text engine must skip and a one-layer MTP module (``mtp.*``).
``text_only=True`` writes the flat ``Qwen3_5ForCausalLM`` layout (weights under ``model.``).

The text config is written with legacy rope keys (``rope_theta``, ``rope_scaling``,
``partial_rotary_factor``); ``write_tiny_checkpoint`` turns them into ``rope_parameters`` for the new
layout. ``layer_types`` deliberately differs from the ``full_attention_interval`` rule, so a loader that
reads the rule instead of the list fails.

Every config value the loader (``Qwen35Config.from_hf_config``) reads is set to a value that is neither its
default nor transformers' (``Qwen3_5TextConfig`` / ``Qwen3_5MoeTextConfig``), so a loader that ignored a
key fails the logits check (``tests/test_qwen35_mutations.py`` proves it for each): ``rms_norm_eps`` 1e-5
(not 1e-6), ``rope_theta`` 1e6 (not 1e4), ``partial_rotary_factor`` 0.5 (not 0.25), ``head_dim`` 32 (not
hidden / heads nor 256), ``linear_conv_kernel_dim`` 3 (not 4), ``full_attention_interval`` 3 (not 4, and
not the rule ``layer_types`` follows), ``num_key_value_heads`` 2 dense / 1 MoE (not the head count, nor
transformers' 4 / 2), ``num_experts_per_tok`` 2 (not 8), ``max_position_embeddings`` 1024 (not 32768).
Left at the defaults, with the reason: ``tie_word_embeddings`` (false; true in the ``tied`` variants),
``hidden_act`` silu and ``attention_bias`` false (the only values the plugin accepts), the rope type
("default"/"mrope" only). Random weights are scaled so the logits are peaked and greedy
decoding has clear margins; dk != dv and GVA (value heads = 2 x key heads) catch transposed or mis-mapped
heads.

``qwen3_next`` writes the flat ``Qwen3NextForCausalLM`` layout of Qwen3-Next (weights under ``model.``):
the fused, key-head-grouped ``in_proj_qkvz`` / ``in_proj_ba`` of its GDN layers, six layers with the FFN
chosen per layer, and beyond the keys above (same values; ``num_key_value_heads`` 1, not transformers'
2) the keys only it has, each off its default: ``decoder_sparse_step`` 2 (not 1) and ``mlp_only_layers``
[5] (not []) make layers 1 and 3 sparse and 0, 2, 4, 5 dense; ``norm_topk_prob`` false (not true);
``intermediate_size`` 128 (not 5632) for the dense layers; no rope scaling, as its published files.
"""

from __future__ import annotations

from typing import Any

import torch

# Keys of the VLM wrapper; every other override goes into ``text_config``.
_TOP_LEVEL_KEYS = frozenset(
    {"architectures", "model_type", "image_token_id", "video_token_id", "vision_start_token_id"}
    | {"vision_end_token_id", "vision_config"}
)


def default_layer_types(num_layers: int) -> list[str]:
    """Full attention at layers 1, 5, 9, ... (the published rule would put it at 3, 7, 11, ...)."""
    return ["full_attention" if i % 4 == 1 else "linear_attention" for i in range(num_layers)]


def _text_config(vocab_size: int, model_type: str) -> dict[str, Any]:
    return {
        "model_type": model_type,
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "full_attention_interval": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 24,
        "linear_conv_kernel_dim": 3,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 1024,
        "rope_theta": 1000000.0,
        "rope_scaling": {"rope_type": "default", "mrope_section": [2, 1, 1], "mrope_interleaved": True},
        "partial_rotary_factor": 0.5,
        "attn_output_gate": True,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "mtp_num_hidden_layers": 1,
        "initializer_range": 0.02,
    }


def _vision_config(out_hidden_size: int) -> dict[str, Any]:
    return {
        "model_type": "qwen3_5_vision",
        "depth": 1,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_heads": 2,
        "in_channels": 3,
        "patch_size": 4,
        "temporal_patch_size": 2,
        "spatial_merge_size": 2,
        "out_hidden_size": out_hidden_size,
        "num_position_embeddings": 16,
        "hidden_act": "gelu_pytorch_tanh",
    }


def _wrap(
    text: dict[str, Any], overrides: dict[str, Any], architecture: str, model_type: str
) -> dict[str, Any]:
    text_only = overrides.pop("text_only", False)
    vision = overrides.pop("vision", not text_only)
    top = {k: overrides.pop(k) for k in list(overrides) if k in _TOP_LEVEL_KEYS}
    text.update(overrides)
    text.setdefault("layer_types", default_layer_types(text["num_hidden_layers"]))
    if text_only:
        return {"architectures": [architecture.replace("ForConditionalGeneration", "ForCausalLM")], **text}
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "text_config": text,
        "image_token_id": 248056,
        "video_token_id": 248057,
        "vision_start_token_id": 248053,
        "vision_end_token_id": 248054,
        "tie_word_embeddings": text["tie_word_embeddings"],
    }
    if vision:
        config["vision_config"] = _vision_config(text["hidden_size"])
    config.update(top)
    return config


def qwen3_5_config(vocab_size: int, **overrides: Any) -> dict[str, Any]:
    text = _text_config(vocab_size, "qwen3_5_text")
    text["intermediate_size"] = 128
    return _wrap(text, overrides, "Qwen3_5ForConditionalGeneration", "qwen3_5")


def qwen3_5_moe_config(vocab_size: int, **overrides: Any) -> dict[str, Any]:
    text = _text_config(vocab_size, "qwen3_5_moe_text")
    text.update(
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            # 1, neither the head count (the loader's default) nor transformers' MoE default of 2.
            "num_key_value_heads": 1,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
            "router_aux_loss_coef": 0.001,
        }
    )
    return _wrap(text, overrides, "Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe")


class _Init:
    def __init__(self, gen: torch.Generator) -> None:
        self.gen = gen

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen)

    def lin(self, out: int, inp: int, gain: float = 1.0) -> torch.Tensor:
        return self.randn(out, inp) * gain * inp**-0.5

    def norm_zero_centred(self, n: int) -> torch.Tensor:
        # Stored around 0: the forward scales by (1 + w).
        return 0.1 * self.randn(n)

    def norm_plain(self, n: int) -> torch.Tensor:
        return 1.0 + 0.1 * self.randn(n)


def _mlp(init: _Init, p: str, h: int, i: int) -> dict[str, torch.Tensor]:
    return {
        p + "gate_proj.weight": init.lin(i, h),
        p + "up_proj.weight": init.lin(i, h),
        p + "down_proj.weight": init.lin(h, i),
    }


def _linear_attention(init: _Init, p: str, cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    h = cfg["hidden_size"]
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv, kc = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], cfg["linear_conv_kernel_dim"]
    conv_dim = 2 * hk * dk + hv * dv
    # Decays exp(g) between about 0.3 and 0.97 per token: the state remembers several tokens back.
    a = torch.empty(hv).uniform_(0.05, 0.8, generator=init.gen)
    return {
        p + "in_proj_qkv.weight": init.lin(conv_dim, h),
        p + "in_proj_z.weight": init.lin(hv * dv, h),
        p + "in_proj_b.weight": init.lin(hv, h),
        p + "in_proj_a.weight": init.lin(hv, h),
        p + "conv1d.weight": init.randn(conv_dim, 1, kc) * kc**-0.5,
        p + "dt_bias": 0.5 * init.randn(hv),
        p + "A_log": a.log(),
        p + "norm.weight": init.norm_plain(dv),
        p + "out_proj.weight": init.lin(h, hv * dv),
    }


def _full_attention(init: _Init, p: str, cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    h, d = cfg["hidden_size"], cfg["head_dim"]
    nq, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    return {
        p + "q_proj.weight": init.lin(nq * 2 * d, h),  # per head: [query (d) | gate (d)]
        p + "k_proj.weight": init.lin(nkv * d, h),
        p + "v_proj.weight": init.lin(nkv * d, h),
        p + "q_norm.weight": init.norm_zero_centred(d),
        p + "k_norm.weight": init.norm_zero_centred(d),
        p + "o_proj.weight": init.lin(h, nq * d),
    }


def _moe(init: _Init, p: str, cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    h, e, ie, is_ = (
        cfg["hidden_size"],
        cfg["num_experts"],
        cfg["moe_intermediate_size"],
        cfg["shared_expert_intermediate_size"],
    )
    # A sharp router: the top-k choice is never a near tie that rounding could flip.
    tensors = {p + "gate.weight": init.lin(e, h, gain=3.0), p + "shared_expert_gate.weight": init.lin(1, h)}
    for expert in range(e):
        tensors.update(_mlp(init, f"{p}experts.{expert}.", h, ie))
    tensors.update(_mlp(init, p + "shared_expert.", h, is_))
    return tensors


def _vision_tensors(init: _Init, vc: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A one-block vision tower with the published names: present on disk, ignored by a text engine."""
    v, i, c, ps, tps = (
        vc["hidden_size"],
        vc["intermediate_size"],
        vc["in_channels"],
        vc["patch_size"],
        vc["temporal_patch_size"],
    )
    merged, out = v * vc["spatial_merge_size"] ** 2, vc["out_hidden_size"]
    p = "model.visual."
    tensors = {
        p + "patch_embed.proj.weight": 0.02 * init.randn(v, c, tps, ps, ps),
        p + "patch_embed.proj.bias": torch.zeros(v),
        p + "pos_embed.weight": 0.02 * init.randn(vc["num_position_embeddings"], v),
        p + "merger.norm.weight": torch.ones(v),
        p + "merger.norm.bias": torch.zeros(v),
        p + "merger.linear_fc1.weight": init.lin(merged, merged),
        p + "merger.linear_fc1.bias": torch.zeros(merged),
        p + "merger.linear_fc2.weight": init.lin(out, merged),
        p + "merger.linear_fc2.bias": torch.zeros(out),
    }
    for block in range(vc["depth"]):
        b = f"{p}blocks.{block}."
        tensors.update(
            {
                b + "norm1.weight": torch.ones(v),
                b + "norm1.bias": torch.zeros(v),
                b + "norm2.weight": torch.ones(v),
                b + "norm2.bias": torch.zeros(v),
                b + "attn.qkv.weight": init.lin(3 * v, v),
                b + "attn.qkv.bias": torch.zeros(3 * v),
                b + "attn.proj.weight": init.lin(v, v),
                b + "attn.proj.bias": torch.zeros(v),
                b + "mlp.linear_fc1.weight": init.lin(i, v),
                b + "mlp.linear_fc1.bias": torch.zeros(i),
                b + "mlp.linear_fc2.weight": init.lin(v, i),
                b + "mlp.linear_fc2.bias": torch.zeros(v),
            }
        )
    return tensors


def _mtp_tensors(init: _Init, cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The published one-layer MTP module: its head and a full-attention decoder layer whose FFN is the
    MoE block when the model has experts. Written after every other tensor, so the main weights are the
    same with or without it."""
    h = cfg["hidden_size"]
    p = "mtp.layers.0."
    tensors = {
        "mtp.fc.weight": init.lin(h, 2 * h),
        "mtp.pre_fc_norm_embedding.weight": init.norm_zero_centred(h),
        "mtp.pre_fc_norm_hidden.weight": init.norm_zero_centred(h),
        "mtp.norm.weight": init.norm_zero_centred(h),
        p + "input_layernorm.weight": init.norm_zero_centred(h),
        p + "post_attention_layernorm.weight": init.norm_zero_centred(h),
    }
    tensors.update(_full_attention(init, p + "self_attn.", cfg))
    if cfg.get("num_experts"):
        tensors.update(_moe(init, p + "mlp.", cfg))
    else:
        tensors.update(_mlp(init, p + "mlp.", h, cfg["intermediate_size"]))
    return tensors


def _tensors(config: dict[str, Any], gen: torch.Generator, moe: bool) -> dict[str, torch.Tensor]:
    init = _Init(gen)
    cfg = config.get("text_config", config)
    prefix = "model.language_model." if "text_config" in config else "model."
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    tensors = {
        prefix + "embed_tokens.weight": init.randn(v, h),
        prefix + "norm.weight": init.norm_zero_centred(h),
    }
    for layer, kind in enumerate(cfg["layer_types"]):
        p = f"{prefix}layers.{layer}."
        tensors[p + "input_layernorm.weight"] = init.norm_zero_centred(h)
        tensors[p + "post_attention_layernorm.weight"] = init.norm_zero_centred(h)
        if kind == "linear_attention":
            tensors.update(_linear_attention(init, p + "linear_attn.", cfg))
        else:
            tensors.update(_full_attention(init, p + "self_attn.", cfg))
        if moe:
            tensors.update(_moe(init, p + "mlp.", cfg))
        else:
            tensors.update(_mlp(init, p + "mlp.", h, cfg["intermediate_size"]))
    if not cfg["tie_word_embeddings"]:
        tensors["lm_head.weight"] = init.randn(v, h) * 0.5
    if "vision_config" in config:
        tensors.update(_vision_tensors(init, config["vision_config"]))
    if cfg.get("mtp_num_hidden_layers"):
        tensors.update(_mtp_tensors(init, cfg))
    return tensors


def qwen3_5_tensors(config: dict[str, Any], gen: torch.Generator) -> dict[str, torch.Tensor]:
    return _tensors(config, gen, moe=False)


def qwen3_5_moe_tensors(config: dict[str, Any], gen: torch.Generator) -> dict[str, torch.Tensor]:
    return _tensors(config, gen, moe=True)


def qwen3_next_config(vocab_size: int, **overrides: Any) -> dict[str, Any]:
    """A flat Qwen3-Next text config (``Qwen3NextForCausalLM``); every override goes to the top level."""
    config = _text_config(vocab_size, "qwen3_next")
    del config["attn_output_gate"]  # Qwen3-Next's attention is always gated; the key is Qwen3.5's
    config.update(
        {
            "architectures": ["Qwen3NextForCausalLM"],
            "num_hidden_layers": 6,
            "num_key_value_heads": 1,
            "rope_scaling": None,
            "intermediate_size": 128,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
            "decoder_sparse_step": 2,
            "mlp_only_layers": [5],
            "norm_topk_prob": False,
            "router_aux_loss_coef": 0.001,
        }
    )
    config.update(overrides)
    config.setdefault("layer_types", default_layer_types(config["num_hidden_layers"]))
    return config


def _qwen3_next_sparse(cfg: dict[str, Any], layer: int) -> bool:
    step, dense_only = cfg.get("decoder_sparse_step", 1), cfg.get("mlp_only_layers") or []
    return cfg.get("num_experts", 0) > 0 and layer not in dense_only and (layer + 1) % step == 0


def qwen3_next_tensors(config: dict[str, Any], gen: torch.Generator) -> dict[str, torch.Tensor]:
    init = _Init(gen)
    h, v = config["hidden_size"], config["vocab_size"]
    tensors = {"model.embed_tokens.weight": init.randn(v, h), "model.norm.weight": init.norm_zero_centred(h)}
    for layer, kind in enumerate(config["layer_types"]):
        p = f"model.layers.{layer}."
        tensors[p + "input_layernorm.weight"] = init.norm_zero_centred(h)
        tensors[p + "post_attention_layernorm.weight"] = init.norm_zero_centred(h)
        if kind == "linear_attention":
            gdn = _linear_attention(init, p + "linear_attn.", config)
            # The same weights, stored fused and grouped by key head, as Qwen3-Next's files are.
            tensors.update(_fuse_gdn_projections(gdn, p + "linear_attn.", config))
        else:
            tensors.update(_full_attention(init, p + "self_attn.", config))
        if _qwen3_next_sparse(config, layer):
            tensors.update(_moe(init, p + "mlp.", config))
        else:
            tensors.update(_mlp(init, p + "mlp.", h, config["intermediate_size"]))
    if not config["tie_word_embeddings"]:
        tensors["lm_head.weight"] = init.randn(v, h) * 0.5
    if config.get("mtp_num_hidden_layers"):
        tensors.update(_mtp_tensors(init, config))
    return tensors


def _fuse_gdn_projections(
    gdn: dict[str, torch.Tensor], p: str, cfg: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """Qwen3.5's separate ``in_proj_qkv/z/b/a`` as Qwen3-Next's ``in_proj_qkvz`` and ``in_proj_ba``: per key
    head g, ``[q_g, k_g, v_g, z_g]`` and ``[b_g, a_g]`` (v_g, z_g, b_g, a_g: its Hv / Hk value heads)."""
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv, h = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], cfg["hidden_size"]
    q, k, vv = gdn.pop(p + "in_proj_qkv.weight").split([hk * dk, hk * dk, hv * dv])
    z, b, a = (gdn.pop(p + f"in_proj_{n}.weight") for n in "zba")

    def grouped(*parts: torch.Tensor) -> torch.Tensor:
        return torch.cat([t.reshape(hk, -1, h) for t in parts], dim=1).reshape(-1, h)

    gdn[p + "in_proj_qkvz.weight"] = grouped(q, k, vv, z)
    gdn[p + "in_proj_ba.weight"] = grouped(b, a)
    return gdn
