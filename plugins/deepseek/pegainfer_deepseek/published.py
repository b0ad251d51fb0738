"""DeepSeek-V3's published config (deepseek-ai/DeepSeek-V3's config.json: 671B in the main model, one MTP
layer, block-FP8 weights), as the keys the plugin reads: the real layer shapes of the benchmarks and the
whole model the memory plan is computed for (``sizing.py``).

Its three dense layers (``first_k_dense_replace``) and 58 MoE layers of 256 experts hold 671.0B
parameters, the published count of the main model; the MTP layer (``model.layers.61``) adds 13.5B with
its own copies of the embedding and the head (11.5B of its own, as DeepSeek counts it).
"""

from __future__ import annotations

from typing import Any

from pegainfer_deepseek.tiny import deepseek_v3_config

#: The architecture keys; ``deepseek_v3_config`` adds the ones every DeepSeek-V3 config shares.
V3_SHAPE: dict[str, Any] = dict(
    hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, first_k_dense_replace=3,
    num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4,
    norm_topk_prob=True, routed_scaling_factor=2.5, max_position_embeddings=163840, rms_norm_eps=1e-6,
    rope_theta=10000.0, num_nextn_predict_layers=1, torch_dtype="bfloat16",
    rope_scaling={
        "type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
    },
)  # fmt: skip
V3_VOCAB = 129280
V3_LAYERS = 61
#: DeepSeek's block FP8: float8 e4m3 weights, one float32 scale per 128 x 128 tile.
FP8_QUANTIZATION: dict[str, Any] = {
    "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]
}  # fmt: skip


def deepseek_v3_published_config(*, mtp: bool = True, fp8: bool = True) -> dict[str, Any]:
    """The published config.json; without its MTP layer unless ``mtp``, with bf16 weights unless ``fp8``."""
    keys = dict(V3_SHAPE, num_hidden_layers=V3_LAYERS)
    if not mtp:
        keys["num_nextn_predict_layers"] = 0
    config = deepseek_v3_config(V3_VOCAB, **keys)
    if fp8:
        config["quantization_config"] = dict(FP8_QUANTIZATION)
    return config
