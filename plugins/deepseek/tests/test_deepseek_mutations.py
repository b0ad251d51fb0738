"""Loader bugs made on purpose fail the conformance suite's logits check against transformers: DeepSeek-V3,
V3.2 and V4.

Each mutation is one a buggy loader could make: a config key it ignores (dropped from the config.json the
loader reads, so its default stands in; transformers still reads the whole file) or a value it computes
wrong (the loaded model edited). The suite's teacher-forced prefill and decode logits must both move past
``logits_tolerance`` for every one of them, while the unmutated model stays within it. The tiny checkpoints
set every key to a non-default value (``pegainfer_deepseek.tiny``, ``pegainfer_deepseek.tiny_v4``) so that
this can hold.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from pegainfer.errors import CheckpointError
from pegainfer.testing.conformance import Mutation, forget, mutated_engine, mutation_errors
from pegainfer.testing.suite import PluginConformance

TOLERANCE = PluginConformance.logits_tolerance
MODELS = {"deepseek_v3": "deepseek", "deepseek_v32": "deepseek", "deepseek_v4": "deepseek_v4"}


def _mla_scale(factor: float) -> Callable[[object], None]:
    def edit(model) -> None:
        for layer in model.layers:
            layer.self_attn.scale *= factor

    return edit


def _v4_scale(factor: float) -> Callable[[object], None]:
    """V4's softmax scale is ``head_dim ** -0.5`` inside ``_attend_block`` (keys are the values too):
    scaling the queries there scales the scores alone."""

    def edit(model) -> None:
        for layer in model.layers:
            attend = layer.self_attn._attend_block
            layer.self_attn._attend_block = lambda q, keys, allowed, attend=attend: attend(
                q * factor, keys, allowed
            )

    return edit


V3 = [
    Mutation("rms_norm_eps-ignored", config=forget("rms_norm_eps")),
    Mutation("rope_theta-ignored", config=forget("rope_theta")),
    Mutation("attention-scale-1%-off", model=_mla_scale(1.01)),
    Mutation("routed_scaling_factor-ignored", config=forget("routed_scaling_factor")),
    Mutation("norm_topk_prob-ignored", config=forget("norm_topk_prob")),
    Mutation("n_shared_experts-ignored", config=forget("n_shared_experts")),
    Mutation("n_group-topk_group-ignored", config=forget("n_group", "topk_group")),
    Mutation("yarn-mscale-ignored", config=forget("mscale", "mscale_all_dim")),
    Mutation("yarn-mscale_all_dim-ignored", config=forget("mscale_all_dim")),
    Mutation("yarn-mscale-only-ignored", config=forget("mscale")),
    Mutation("yarn-beta_fast-ignored", config=forget("beta_fast")),
    Mutation("yarn-beta_slow-ignored", config=forget("beta_slow")),
    Mutation(
        "yarn-original_max_position_embeddings-ignored", config=forget("original_max_position_embeddings")
    ),
    Mutation("yarn-truncate-ignored", config=forget("truncate")),
]
V32 = [*V3, Mutation("index_topk-ignored", config=forget("index_topk"))]
V4 = [
    Mutation("rms_norm_eps-ignored", config=forget("rms_norm_eps")),
    Mutation("main-rope_theta-ignored", config=forget("rope_parameters.main.rope_theta")),
    Mutation("compress-rope_theta-ignored", config=forget("rope_parameters.compress.rope_theta")),
    Mutation("partial_rotary_factor-ignored", config=forget("partial_rotary_factor")),
    Mutation("attention-scale-1%-off", model=_v4_scale(1.01)),
    Mutation("routed_scaling_factor-ignored", config=forget("routed_scaling_factor")),
    Mutation("swiglu_limit-ignored", config=forget("swiglu_limit")),
    Mutation("hc_sinkhorn_iters-ignored", config=forget("hc_sinkhorn_iters")),
    Mutation("hc_eps-ignored", config=forget("hc_eps")),
    Mutation("yarn-attention_factor-ignored", config=forget("attention_factor")),
    Mutation("yarn-beta_fast-ignored", config=forget("beta_fast")),
    Mutation("yarn-beta_slow-ignored", config=forget("beta_slow")),
    Mutation(
        "yarn-original_max_position_embeddings-ignored", config=forget("original_max_position_embeddings")
    ),
    Mutation("index_topk-ignored", config=forget("index_topk")),
]
CASES = [
    *(("deepseek_v3", m) for m in V3),
    *(("deepseek_v32", m) for m in V32),
    *(("deepseek_v4", m) for m in V4),
]

#: Keys a loader cannot ignore without building weights of the wrong shape: it must refuse the checkpoint.
REFUSED = [
    ("deepseek_v3", "first_k_dense_replace"),
    ("deepseek_v3", "q_lora_rank"),
    ("deepseek_v32", "index_n_heads"),
    ("deepseek_v4", "compress_rates"),
    ("deepseek_v4", "hc_mult"),
    ("deepseek_v4", "o_groups"),
]


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint_factory: Callable[..., Path]) -> Callable[[str], Path]:
    return tiny_checkpoint_factory


@pytest.mark.parametrize("architecture", list(MODELS))
def test_unmutated_model_passes(checkpoints, tmp_path: Path, architecture: str) -> None:
    folder = checkpoints(architecture)
    prefill, decode = mutation_errors(MODELS[architecture], folder, Mutation("none"), tmp_path)
    print(f"{architecture} unmutated: prefill {prefill:.2e}, decode {decode:.2e}")
    assert prefill < TOLERANCE and decode < TOLERANCE, (prefill, decode)


@pytest.mark.parametrize(("architecture", "mutation"), CASES, ids=[f"{a}-{m}" for a, m in CASES])
def test_mutation_fails_the_logits_check(
    checkpoints, tmp_path: Path, architecture: str, mutation: Mutation
) -> None:
    folder = checkpoints(architecture)
    prefill, decode = mutation_errors(MODELS[architecture], folder, mutation, tmp_path)
    print(f"{architecture} {mutation}: prefill {prefill:.2e}, decode {decode:.2e}")
    assert prefill > TOLERANCE and decode > TOLERANCE, (prefill, decode)


@pytest.mark.parametrize(("architecture", "key"), REFUSED, ids=[f"{a}-{k}" for a, k in REFUSED])
def test_ignoring_a_shape_key_is_refused(checkpoints, tmp_path: Path, architecture: str, key: str) -> None:
    mutation = Mutation(f"{key}-ignored", config=forget(key))
    with pytest.raises(CheckpointError, match="shape|missing"):
        mutated_engine(MODELS[architecture], checkpoints(architecture), mutation, tmp_path)
