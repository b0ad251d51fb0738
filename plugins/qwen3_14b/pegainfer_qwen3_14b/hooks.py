"""Plugin hooks for Qwen3 dense: registered through the ``pegainfer`` entry point like any third party's."""

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
            name="qwen3_14b",
            model_class="pegainfer_qwen3_14b.model:Qwen3ForCausalLM",
            architectures=("Qwen3ForCausalLM",),
            model_types=("qwen3",),
            description="Qwen3 dense (any size; 14B is the flagship)",
            demo_checkpoint="pegainfer_qwen3_14b.demo:write_demo_checkpoint",
        )
    )


@hookimpl
def register_config_dirs(register: Callable[[str], None]) -> None:
    register("pkg://pegainfer_qwen3_14b.conf")


@hookimpl
def register_tiny_checkpoints(register: Callable[[TinyCheckpointBuilder], None]) -> None:
    register(
        TinyCheckpointBuilder(
            "qwen3", "pegainfer_qwen3_14b.tiny:qwen3_config", "pegainfer_qwen3_14b.tiny:qwen3_tensors"
        )
    )
