"""The toy plugin's hooks: a name, what checkpoints it claims, and lazy strings for its classes."""

from __future__ import annotations

from collections.abc import Callable

from pegainfer.plugins.registry import ModelRegistration, hookimpl


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
        )
    )


@hookimpl
def register_config_dirs(register: Callable[[str], None]) -> None:
    register("pkg://pegainfer_toy.conf")
