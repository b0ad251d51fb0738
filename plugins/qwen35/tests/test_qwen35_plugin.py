"""The qwen35 plugin's registration: the checkpoints it claims and its Hydra option."""

from __future__ import annotations

import pytest

from pegainfer.config.compose import build_engine_config, compose
from pegainfer.plugins.registry import get_model_registry


@pytest.mark.parametrize(
    "hf_config",
    [
        {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5"},
        {"architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text"},
        # A VLM config whose top level names nothing pegainfer knows: the text_config decides.
        {"model_type": "qwen3_5_vl_future", "text_config": {"model_type": "qwen3_5_text"}},
    ],
)
def test_qwen35_claims_its_checkpoints(hf_config: dict[str, object]) -> None:
    registration = get_model_registry().resolve(hf_config)
    assert (registration.name, registration.plugin, registration.package) == (
        "qwen35",
        "qwen35",
        "pegainfer-qwen35",
    )
    assert registration.model_class == "pegainfer_qwen35.model:Qwen35ForCausalLM"


def test_qwen35_model_option_composes() -> None:
    config = build_engine_config(compose("generate", ["model=qwen35", "model.dtype=bfloat16"]))
    assert (config.model.name, config.model.dtype) == ("qwen35", "bfloat16")
