"""Plugin hooks for DeepSeek V3 / V3.2 and V4: the model classes are imported only when such a model is built."""

from __future__ import annotations

from collections.abc import Callable

from pegainfer.plugins import ModelRegistration, TinyCheckpointBuilder, hookimpl


@hookimpl
def pegainfer_plugin_api_version() -> int:
    return 2


@hookimpl
def register_models(register: Callable[[ModelRegistration], None]) -> None:
    register(
        ModelRegistration(
            name="deepseek",
            model_class="pegainfer_deepseek.model:DeepseekV3ForCausalLM",
            config_schema="pegainfer_deepseek.config:DeepseekModelConfig",
            architectures=("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM"),
            model_types=("deepseek_v3", "deepseek_v32"),
            description="DeepSeek-V3 / R1 and V3.2 (MLA, group-routed MoE)",
            demo_checkpoint="pegainfer_deepseek.demo:write_v3_demo_checkpoint",
        )
    )
    register(
        ModelRegistration(
            name="deepseek_v4",
            model_class="pegainfer_deepseek.v4_model:DeepseekV4ForCausalLM",
            architectures=("DeepseekV4ForCausalLM",),
            model_types=("deepseek_v4",),
            description="DeepSeek-V4 (mHC streams, sliding + compressed attention, hash-routed MoE)",
            demo_checkpoint="pegainfer_deepseek.demo:write_v4_demo_checkpoint",
        )
    )


@hookimpl
def register_config_dirs(register: Callable[[str], None]) -> None:
    register("pkg://pegainfer_deepseek.conf")


@hookimpl
def register_tiny_checkpoints(register: Callable[[TinyCheckpointBuilder], None]) -> None:
    register(
        TinyCheckpointBuilder(
            "deepseek_v3",
            "pegainfer_deepseek.tiny:deepseek_v3_config",
            "pegainfer_deepseek.tiny:deepseek_v3_tensors",
        )
    )
    register(
        TinyCheckpointBuilder(
            "deepseek_v32",
            "pegainfer_deepseek.tiny:deepseek_v32_config",
            "pegainfer_deepseek.tiny:deepseek_v32_tensors",
        )
    )
    register(
        TinyCheckpointBuilder(
            "deepseek_v4",
            "pegainfer_deepseek.tiny_v4:deepseek_v4_config",
            "pegainfer_deepseek.tiny_v4:deepseek_v4_tensors",
            legacy_rope="pegainfer_deepseek.tiny_v4:legacy_rope",
        )
    )
