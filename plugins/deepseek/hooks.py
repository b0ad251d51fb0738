"""Plugin hooks for DeepSeek V3 / V3.2: the model class is imported only when such a model is built."""

from __future__ import annotations

from collections.abc import Callable

from pegainfer.plugins import ModelRegistration, hookimpl


@hookimpl
def pegainfer_plugin_api_version() -> int:
    return 1


@hookimpl
def register_models(register: Callable[[ModelRegistration], None]) -> None:
    register(
        ModelRegistration(
            name="deepseek",
            model_class="pegainfer_deepseek.model:DeepseekV3ForCausalLM",
            architectures=("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM"),
            model_types=("deepseek_v3", "deepseek_v32"),
            description="DeepSeek-V3 / R1 and V3.2 (MLA, group-routed MoE)",
        )
    )


@hookimpl
def register_config_dirs(register: Callable[[str], None]) -> None:
    register("pkg://pegainfer_deepseek.conf")
