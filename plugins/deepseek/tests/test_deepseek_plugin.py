"""The deepseek plugin's registration: the checkpoints it claims and its Hydra option."""

from __future__ import annotations

import pytest

from pegainfer.config.compose import build_engine_config, compose
from pegainfer.plugins.registry import get_model_registry


@pytest.mark.parametrize(
    "hf_config",
    [
        {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"},
        {"architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32"},
    ],
)
def test_deepseek_claims_its_checkpoints(hf_config: dict[str, object]) -> None:
    registration = get_model_registry().resolve(hf_config)
    assert (registration.name, registration.plugin, registration.package) == (
        "deepseek",
        "deepseek",
        "pegainfer-deepseek",
    )
    assert registration.model_class == "pegainfer_deepseek.model:DeepseekV3ForCausalLM"


def test_deepseek_v4_is_claimed_by_its_own_model() -> None:
    registration = get_model_registry().resolve(
        {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4"}
    )
    assert (registration.name, registration.plugin) == ("deepseek_v4", "deepseek")
    assert registration.model_class == "pegainfer_deepseek.v4_model:DeepseekV4ForCausalLM"
    # A config without "architectures" is claimed by its model_type.
    assert get_model_registry().resolve({"model_type": "deepseek_v4"}).name == "deepseek_v4"


def test_deepseek_model_option_composes() -> None:
    config = build_engine_config(compose("generate", ["model=deepseek", "tp=8"]))
    assert (config.model.name, config.parallel.tensor_parallel_size) == ("deepseek", 8)
