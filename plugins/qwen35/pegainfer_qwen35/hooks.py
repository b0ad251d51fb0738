"""Plugin hooks for Qwen3.5 and Qwen3-Next: the model class is imported only when such a model is built.

Qwen3-Next is registered under the ``qwen35`` model, not a name of its own: it is the same decoder (the
same model class reads either config, ``Qwen35Config.from_hf_config``), so it shares the Hydra option, the
checks and the kernels; a checkpoint is matched to it by its architecture / ``model_type``.
"""

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
            name="qwen35",
            model_class="pegainfer_qwen35.model:Qwen35ForCausalLM",
            # The published checkpoints are VLMs; the text-only and MoE variants share the decoder.
            architectures=(
                "Qwen3_5ForConditionalGeneration",
                "Qwen3_5ForCausalLM",
                "Qwen3_5MoeForConditionalGeneration",
                "Qwen3_5MoeForCausalLM",
                # Its predecessor: fused GDN projections, MoE or dense FFN per layer.
                "Qwen3NextForCausalLM",
            ),
            model_types=("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next"),
            description="Qwen3.5 hybrid (Gated DeltaNet + gated attention), dense and MoE; Qwen3-Next",
            demo_checkpoint="pegainfer_qwen35.demo:write_demo_checkpoint",
        )
    )


@hookimpl
def register_config_dirs(register: Callable[[str], None]) -> None:
    register("pkg://pegainfer_qwen35.conf")


@hookimpl
def register_tiny_checkpoints(register: Callable[[TinyCheckpointBuilder], None]) -> None:
    register(
        TinyCheckpointBuilder(
            "qwen3_5", "pegainfer_qwen35.tiny:qwen3_5_config", "pegainfer_qwen35.tiny:qwen3_5_tensors"
        )
    )
    register(
        TinyCheckpointBuilder(
            "qwen3_5_moe",
            "pegainfer_qwen35.tiny:qwen3_5_moe_config",
            "pegainfer_qwen35.tiny:qwen3_5_moe_tensors",
        )
    )
    register(
        TinyCheckpointBuilder(
            "qwen3_next",
            "pegainfer_qwen35.tiny:qwen3_next_config",
            "pegainfer_qwen35.tiny:qwen3_next_tensors",
        )
    )
