"""Loader bugs made on purpose fail the conformance suite's logits check against transformers, dense and
MoE.

Each mutation is one a buggy loader could make: a config key it ignores (dropped from the config.json the
loader reads, so its default stands in; transformers still reads the whole file) or a value it computes
wrong (the loaded model edited). The suite's teacher-forced prefill and decode logits must both move past
``logits_tolerance`` for every one of them, while the unmutated model stays within it. The tiny checkpoints
set every key to a non-default value (``pegainfer_qwen35.tiny``) so that this can hold.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from pegainfer.errors import CheckpointError
from pegainfer.testing.conformance import Mutation, forget, mutated_engine, mutation_errors
from pegainfer.testing.suite import PluginConformance
from pegainfer_qwen35.attention import GatedAttention

MODEL = "qwen35"
TOLERANCE = PluginConformance.logits_tolerance


def _attention_scale(factor: float) -> Callable[[object], None]:
    def edit(model) -> None:
        layers = [m for m in model.modules() if isinstance(m, GatedAttention)]
        assert layers
        for layer in layers:
            layer.scale *= factor

    return edit


MUTATIONS = [
    Mutation("rms_norm_eps-ignored", config=forget("rms_norm_eps")),
    Mutation("rope_theta-ignored", config=forget("rope_theta")),
    Mutation("partial_rotary_factor-ignored", config=forget("partial_rotary_factor")),
    Mutation("attention-scale-1%-off", model=_attention_scale(1.01)),
]

#: Keys a loader cannot ignore without building weights of the wrong shape or kind: it must refuse.
REFUSED = ["linear_conv_kernel_dim", "num_key_value_heads", "layer_types"]


def test_unmutated_model_passes(tiny_qwen35: Path, tmp_path: Path) -> None:
    prefill, decode = mutation_errors(MODEL, tiny_qwen35, Mutation("none"), tmp_path)
    print(f"unmutated: prefill {prefill:.2e}, decode {decode:.2e}")
    assert prefill < TOLERANCE and decode < TOLERANCE, (prefill, decode)


@pytest.mark.parametrize("mutation", MUTATIONS, ids=str)
def test_mutation_fails_the_logits_check(tiny_qwen35: Path, tmp_path: Path, mutation: Mutation) -> None:
    prefill, decode = mutation_errors(MODEL, tiny_qwen35, mutation, tmp_path)
    print(f"{mutation}: prefill {prefill:.2e}, decode {decode:.2e}")
    assert prefill > TOLERANCE and decode > TOLERANCE, (prefill, decode)


@pytest.mark.parametrize("key", REFUSED)
def test_ignoring_a_shape_key_is_refused(tiny_qwen35: Path, tmp_path: Path, key: str) -> None:
    with pytest.raises(CheckpointError, match="shape|missing"):
        mutated_engine(MODEL, tiny_qwen35, Mutation(f"{key}-ignored", config=forget(key)), tmp_path)
