"""The whole published DeepSeek-V3 (671B, FP8) at tp=8, checked on the CPU: one rank's model built on the
meta device (``pegainfer_deepseek.sizing``) holds an eighth of the model plus the parts every rank keeps
whole, derived here from the config alone, and the engine's memory plan fits 64 requests of 4096 tokens
beside its weights and transients on an H200. A rank that kept whole what it should slice (the experts,
a projection's heads or features, the vocabulary) fails the first; weights grown past an H200's share,
the second.
"""

from __future__ import annotations

import pytest

from pegainfer.config.schema import EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from pegainfer_deepseek.published import deepseek_v3_published_config
from pegainfer_deepseek.sizing import (
    build_on_meta,
    bytes_by_part,
    gpu_plan,
    kv_bytes_per_token,
    parameter_count,
)

TP = 8
H200_BYTES = 143771 << 20  # torch's total for an H200
#: The parts every rank holds in full, all others sliced evenly (the MLA part only in part: its latent
#: down projections are whole on every rank).
SLICED = ("routed experts", "shared experts", "dense MLP", "embedding", "lm_head")


@pytest.fixture(scope="module")
def config() -> dict:
    return deepseek_v3_published_config(mtp=False)


@pytest.fixture(scope="module")
def engine() -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(max_model_len=4096),
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=8192),
    )


@pytest.fixture(scope="module")
def whole(config, engine):
    """The one-rank model."""
    return build_on_meta(config, engine)


def replicated_bytes(cfg: dict) -> int:
    """What every rank holds in full, from the config: per layer the stacked q_a / kv_a projection (float8
    with a float32 scale per row and 128 columns), its two norms and the layer's two (bf16); per MoE layer
    the float32 router and its bias; the final norm."""
    h, rq = cfg["hidden_size"], cfg["q_lora_rank"]
    latent = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    in_proj = (rq + latent) * (h + -(-h // 128) * 4)
    norms = (rq + cfg["kv_lora_rank"] + 2 * h) * 2
    router = cfg["n_routed_experts"] * (h + 1) * 4
    layers, dense = cfg["num_hidden_layers"], cfg["first_k_dense_replace"]
    return layers * (in_proj + norms) + (layers - dense) * router + h * 2


def test_the_published_main_model_has_671b_parameters(whole) -> None:
    params = parameter_count(whole)
    assert abs(params / 671e9 - 1) < 0.001, params


@pytest.mark.parametrize("rank", [0, TP - 1])
def test_a_rank_of_eight_holds_an_eighth_plus_the_replicated_parts(config, engine, whole, rank: int) -> None:
    whole = bytes_by_part(whole)
    parts = bytes_by_part(build_on_meta(config, engine, rank, TP))
    replicated = replicated_bytes(config)
    expected = (sum(whole.values()) - replicated) / TP + replicated
    assert abs(sum(parts.values()) / expected - 1) < 0.005, (sum(parts.values()), expected)
    for part in SLICED:
        assert parts[part] * TP == whole[part], part
    assert parts["router"] == whole["router"]


def test_64_requests_of_4096_tokens_fit_an_h200_per_rank(config, engine) -> None:
    model = build_on_meta(config, engine, 0, TP)
    per_token = kv_bytes_per_token(model, engine)
    # The latent cache is the whole latent on every rank, whatever tp: kv_lora_rank + rope, bf16, a layer.
    latent = config["kv_lora_rank"] + config["qk_rope_head_dim"]
    assert per_token == config["num_hidden_layers"] * latent * 2
    plan = gpu_plan(model, config, engine, H200_BYTES)
    sched = engine.scheduler
    assert plan.budget == int(0.9 * H200_BYTES)
    kv = sched.max_num_seqs * engine.model.max_model_len * per_token
    assert plan.weight_bytes + plan.transient_bytes + kv <= plan.budget
    assert plan.num_blocks * plan.block_size >= sched.max_num_seqs * engine.model.max_model_len


def test_only_mtp_drafting_builds_the_mtp_layer() -> None:
    """The plan's model has the MTP layer when it drafts with it, not for prompt lookup."""
    config = deepseek_v3_published_config(mtp=True)

    def mtp_layers(**speculative: object) -> int:
        engine = EngineConfig(
            model=ModelConfig(max_model_len=4096), speculative=SpeculativeConfig(**speculative)
        )
        return build_on_meta(config, engine, 0, TP).num_mtp_layers

    assert mtp_layers(num_tokens=1) == 1
    assert mtp_layers(num_tokens=3, method="ngram") == 0
