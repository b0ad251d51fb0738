"""What one tensor-parallel rank of a DeepSeek-V3 model holds, computed without the memory: the rank's
model built on torch's ``meta`` device (shapes and dtypes only, weights as an FP8 checkpoint loads them:
float8 with their scales), its weight bytes by part, and the engine's own memory plan for it
(``pegainfer.memory.rank_plan``) on a GPU of a given size. For models no machine here holds: the whole
published DeepSeek-V3 at tp=8 (``bench/deepseek_671b_plan.py``, ``tests/test_deepseek_671b_plan.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pegainfer.config.schema import EngineConfig
from pegainfer.memory.memory_plan import MemoryPlan
from pegainfer.memory.rank_plan import plan_rank_memory
from pegainfer.model.model_loader import LoadedModel, parameter_bytes, pick_dtype, plugin_model_config
from pegainfer.parallel.distributed import TensorParallel
from pegainfer.plugins.registry import get_model_registry
from pegainfer.scheduling.speculative import paged_buffer_specs
from pegainfer_deepseek.model import DeepseekV3ForCausalLM

#: The parts a rank's weight bytes are told in, in table order.
PARTS = (
    "routed experts", "shared experts", "dense MLP", "attention (MLA)", "router", "embedding", "lm_head",
    "norms", "FP8 scales", "MTP layer",
)  # fmt: skip


def is_scale(name: str) -> bool:
    """Whether parameter ``name`` holds FP8 scales: a BlockFP8Weight's per-row ones, the experts' tiles."""
    leaf = name.rsplit(".", 1)[-1]
    return leaf == "scale" or leaf.endswith("_scale")


def part_of(name: str) -> str:
    """The part parameter ``name`` of ``DeepseekV3ForCausalLM`` belongs to; a ValueError for one no rule
    names, so a new parameter is not counted in the wrong part."""
    leaf = name.rsplit(".", 1)[-1]
    if name.startswith("mtp."):
        return "MTP layer"
    if is_scale(name):
        return "FP8 scales"
    if "norm" in leaf:
        return "norms"
    rules = (
        ("embed_tokens", "embedding"),
        ("lm_head", "lm_head"),
        (".mlp.experts_", "routed experts"),
        (".mlp.shared_experts.", "shared experts"),
        (".mlp.gate.", "router"),
        (".mlp.", "dense MLP"),
        (".self_attn.", "attention (MLA)"),
    )
    for key, part in rules:
        if key in name:
            return part
    raise ValueError(f"parameter {name!r} belongs to no part of {PARTS}")


def build_on_meta(
    hf_config: dict[str, Any], engine: EngineConfig, rank: int = 0, size: int = 1
) -> DeepseekV3ForCausalLM:
    """Rank ``rank`` of ``size``'s model on the meta device, as ``load_model`` builds it on a GPU for
    ``engine`` (its dtype, ``max_model_len``, MTP modules only when drafting). Building calls no
    collective, so a placeholder stands for the ranks' group."""
    tp = TensorParallel(rank=rank, size=size, group=object()) if size > 1 else TensorParallel()
    max_model_len = engine.model.max_model_len or DeepseekV3ForCausalLM.max_context_length(hf_config)
    with torch.device("meta"):
        return DeepseekV3ForCausalLM.from_hf_config(
            hf_config,
            plugin_model_config(get_model_registry().get("deepseek"), engine.model),
            dtype=pick_dtype(engine.model.dtype, hf_config, torch.device("cuda")),
            max_model_len=max_model_len,
            tp=tp,
            drafting=engine.speculative.mtp_tokens > 0,
        )


def bytes_by_part(model: DeepseekV3ForCausalLM) -> dict[str, int]:
    """The model's parameter bytes in each of ``PARTS`` it has, in their order."""
    parts = dict.fromkeys(PARTS, 0)
    for name, p in model.named_parameters():
        parts[part_of(name)] += p.numel() * p.element_size()
    return {part: n for part, n in parts.items() if n}


def parameter_count(model: DeepseekV3ForCausalLM) -> int:
    """The model's parameters less the FP8 scales: what a checkpoint's size is published as."""
    return sum(p.numel() for name, p in model.named_parameters() if not is_scale(name))


def kv_bytes_per_token(model: DeepseekV3ForCausalLM, engine: EngineConfig) -> int:
    """What a token's pages take on the rank: every layer's latent cache (and the MTP layers' when
    drafting)."""
    specs = paged_buffer_specs(model, engine.speculative)
    return sum(spec.bytes_per_token for spec in specs)


def gpu_plan(
    model: DeepseekV3ForCausalLM, hf_config: dict[str, Any], engine: EngineConfig, gpu_bytes: int
) -> MemoryPlan:
    """The engine's plan for ``model`` (one rank, from ``build_on_meta``) on a GPU of ``gpu_bytes`` that
    holds nothing else: ``cache.gpu_memory_utilization`` of it (a real rank also loses its CUDA context
    and NCCL buffers), CUDA graphs captured unless ``enforce_eager``. Every rank holds the same shard
    sizes, so rank 0's page count is the one all ranks agree on."""
    loaded = LoadedModel(
        model,
        get_model_registry().get("deepseek"),
        hf_config,
        Path(),
        torch.device("cuda"),  # the device planned for: nothing reads the (meta) weights
        model.dtype,
        model.max_model_len,
        parameter_bytes(model),
    )
    specs = paged_buffer_specs(model, engine.speculative)
    return plan_rank_memory(
        loaded,
        engine,
        specs,
        TensorParallel(),
        graphs=model.decode_graphs and not engine.enforce_eager,
        budget=int(gpu_bytes * engine.cache.gpu_memory_utilization),
    )
