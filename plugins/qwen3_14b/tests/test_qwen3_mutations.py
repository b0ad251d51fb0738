"""Loader bugs made on purpose fail the conformance suite's logits check against transformers.

Each mutation is one a buggy loader could make: a config key it ignores (dropped from the config.json the
loader reads, so its default stands in; transformers still reads the whole file) or a value it computes
wrong (the loaded model edited). The suite's teacher-forced prefill and decode logits must both move past
``logits_tolerance`` for every one of them, while the unmutated model stays within it. The tiny checkpoint
sets every key to a non-default value (``pegainfer_qwen3_14b.tiny``) so that this can hold.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from pegainfer.errors import CheckpointError
from pegainfer.testing.conformance import Mutation, forget, mutated_engine, mutation_errors
from pegainfer.testing.suite import PluginConformance

MODEL = "qwen3_14b"
TOLERANCE = PluginConformance.logits_tolerance


def _attention_scale(factor: float) -> Callable[[object], None]:
    def edit(model) -> None:
        for layer in model.layers:
            layer.scale *= factor

    return edit


MUTATIONS = [
    Mutation("rms_norm_eps-ignored", config=forget("rms_norm_eps")),
    Mutation("rope_theta-ignored", config=forget("rope_theta")),
    Mutation("attention-scale-1%-off", model=_attention_scale(1.01)),
]

#: Keys a loader cannot ignore without building weights of the wrong shape: it must refuse the checkpoint.
REFUSED = ["head_dim", "num_key_value_heads"]


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint_factory: Callable[..., Path]) -> Path:
    return tiny_checkpoint_factory("qwen3")


def test_unmutated_model_passes(checkpoint: Path, tmp_path: Path) -> None:
    prefill, decode = mutation_errors(MODEL, checkpoint, Mutation("none"), tmp_path)
    print(f"unmutated: prefill {prefill:.2e}, decode {decode:.2e}")
    assert prefill < TOLERANCE and decode < TOLERANCE, (prefill, decode)


@pytest.mark.parametrize("mutation", MUTATIONS, ids=str)
def test_mutation_fails_the_logits_check(checkpoint: Path, tmp_path: Path, mutation: Mutation) -> None:
    prefill, decode = mutation_errors(MODEL, checkpoint, mutation, tmp_path)
    print(f"{mutation}: prefill {prefill:.2e}, decode {decode:.2e}")
    assert prefill > TOLERANCE and decode > TOLERANCE, (prefill, decode)


@pytest.mark.parametrize("key", REFUSED)
def test_ignoring_a_shape_key_is_refused(checkpoint: Path, tmp_path: Path, key: str) -> None:
    with pytest.raises(CheckpointError, match="shape"):
        mutated_engine(MODEL, checkpoint, Mutation(f"{key}-ignored", config=forget(key)), tmp_path)
