"""The toy plugin's hooks: a name, what checkpoints it claims, its tiny checkpoint, and lazy strings for
its classes (nothing heavy is imported until a model is built or a checkpoint written)."""

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
            name="toy_qwen3",
            model_class="pegainfer_toy.model:ToyQwen3ForCausalLM",
            architectures=("ToyQwen3ForCausalLM",),
            model_types=("toy_qwen3",),
            config_schema="pegainfer_toy.config:ToyQwen3Config",
            description="Qwen3 with a configurable logit scale (a test plugin)",
            demo_checkpoint="pegainfer_toy.tiny:write_demo_checkpoint",
        )
    )


@hookimpl
def register_config_dirs(register: Callable[[str], None]) -> None:
    register("pkg://pegainfer_toy.conf")


@hookimpl
def register_tiny_checkpoints(register: Callable[[TinyCheckpointBuilder], None]) -> None:
    register(
        TinyCheckpointBuilder(
            "toy_qwen3", "pegainfer_toy.tiny:toy_qwen3_config", "pegainfer_toy.tiny:toy_qwen3_tensors"
        )
    )
