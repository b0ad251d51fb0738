"""Building a runnable model from an EngineConfig: checkpoint folder, plugin, device, dtype, weights."""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pegainfer.config.schema import EngineConfig, ModelConfig, validate_section
from pegainfer.errors import CheckpointError, ConfigError
from pegainfer.layers.block_fp8 import BlockFP8Weight, row_scales, settle_scales
from pegainfer.model.checkpoint import CheckpointReader, checkpoint_dtype, parse_dtype, read_hf_config
from pegainfer.model.model_api import CausalLM
from pegainfer.parallel.distributed import TensorParallel
from pegainfer.plugins.demo import demo_checkpoint
from pegainfer.plugins.registry import ModelRegistration, get_model_registry

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: CausalLM
    registration: ModelRegistration
    hf_config: dict[str, Any]
    folder: Path
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    weight_bytes: int


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device: 'cuda' was asked for but torch sees no CUDA device")
    return device


def pick_dtype(requested: str, hf_config: dict[str, Any], device: torch.device) -> torch.dtype:
    """``auto``: float32 on the CPU (the reference path); on a GPU the checkpoint's dtype, bf16 for fp32 files."""
    if requested != "auto":
        return parse_dtype(requested)
    if device.type == "cpu":
        return torch.float32
    saved = checkpoint_dtype(hf_config)
    return torch.bfloat16 if saved == torch.float32 else saved


def text_config(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The language-model part of a (possibly multimodal) config."""
    return hf_config.get("text_config") or hf_config


def resolve_registration(config: EngineConfig) -> tuple[ModelRegistration, Path, dict[str, Any]]:
    """The model registration ``config`` selects, its checkpoint folder and parsed config.json. Without
    ``model.path`` the folder is the model's embedded demo checkpoint (``pegainfer.plugins.demo``)."""
    registry = get_model_registry()
    name = config.model.name
    if config.model.path is None:
        if name == "auto":
            try:
                registration = registry.get(config.demo_model)
            except ConfigError as err:
                raise ConfigError(f"no model.path given, and demo_model: {err}") from None
        else:
            registration = registry.get(name)
        folder = demo_checkpoint(registration)
        return registration, folder, read_hf_config(folder)
    folder = Path(config.model.path).expanduser()
    hf_config = read_hf_config(folder)
    registration = registry.resolve(hf_config) if name == "auto" else registry.get(name)
    return registration, folder, hf_config


def pick_rank_device(name: str, tp: TensorParallel) -> torch.device:
    """The device of tensor-parallel rank ``tp.rank``: its own GPU (``cuda:<rank>``) on CUDA."""
    device = pick_device(name)
    if device.type == "cuda" and tp.size > 1:
        if device.index not in (None, 0):
            raise ConfigError(f"device: '{name}' with tp={tp.size}; tensor-parallel ranks take cuda:0..tp-1")
        return torch.device("cuda", tp.device_index)
    return device


def model_class(registration: ModelRegistration, tp_size: int = 1) -> type[CausalLM]:
    """The registration's CausalLM class; a ConfigError when ``tp_size`` > 1 and the class takes no ``tp``
    (a model written before tensor parallelism, or one that does not shard)."""
    model_cls = registration.load_model_class()
    if not (isinstance(model_cls, type) and issubclass(model_cls, CausalLM)):
        raise CheckpointError(
            f"{registration.origin}: {registration.model_class} is not a pegainfer CausalLM"
        )
    if tp_size > 1 and "tp" not in inspect.signature(model_cls.from_hf_config).parameters:
        raise ConfigError(
            f"model '{registration.name}' from {registration.origin} does not support tensor parallelism "
            f"(its from_hf_config takes no 'tp'); run it with tp=1"
        )
    return model_cls


def plugin_model_config(registration: ModelRegistration, model_config: ModelConfig) -> ModelConfig:
    """``model_config`` as the plugin's own schema: a caller that built a plain ModelConfig (the offline
    API, a test) gets the schema's defaults for the plugin's keys, and its values validated by it."""
    schema = registration.load_config_schema()
    if isinstance(model_config, schema):
        return model_config
    return validate_section(schema, model_config.model_dump(), "model")


def load_model(config: EngineConfig, tp: TensorParallel | None = None) -> LoadedModel:
    """Build ``config``'s model (tensor-parallel rank ``tp``'s shard of it) and fill its weights."""
    tp = tp or TensorParallel()
    registration, folder, hf_config = resolve_registration(config)
    model_cls = model_class(registration, tp.size)
    device = pick_rank_device(config.device, tp)
    dtype = pick_dtype(config.model.dtype, hf_config, device)
    limit = model_cls.max_context_length(text_config(hf_config))
    max_model_len = config.model.max_model_len or limit
    if max_model_len > limit:
        raise ConfigError(
            f"model.max_model_len={max_model_len} exceeds the checkpoint's max_position_embeddings ({limit})"
        )
    kwargs: dict[str, Any] = {"dtype": dtype, "max_model_len": max_model_len}
    parameters = inspect.signature(model_cls.from_hf_config).parameters
    if "tp" in parameters:
        kwargs["tp"] = tp
    if "drafting" in parameters:
        kwargs["drafting"] = config.speculative.mtp_tokens > 0
    if device.index is not None and device.type == "cuda":
        torch.cuda.set_device(device)  # a rank's collectives and graphs run on its own GPU
    with torch.device(device):
        model = model_cls.from_hf_config(hf_config, plugin_model_config(registration, config.model), **kwargs)
    if config.model.load_format == "dummy":
        init_dummy_weights(model, seed=config.seed)
    else:
        reader = CheckpointReader(folder, rank=tp.rank, world_size=tp.size)
        model.load_weights(reader)
        unused = reader.unused()
        if unused:
            logger.warning("%d checkpoint tensors were not used, e.g. %s", len(unused), ", ".join(unused[:3]))
        reader.close()
    settle_scales(model)
    model.eval()
    weight_bytes = parameter_bytes(model)
    logger.info("loaded %s from %s (%s, %s)", registration.name, folder, dtype, device)
    return LoadedModel(model, registration, hf_config, folder, device, dtype, max_model_len, weight_bytes)


def parameter_bytes(model: torch.nn.Module) -> int:
    """What ``model``'s parameters take: the weight bytes the memory plan counts."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


#: Elements of a float8 weight drawn at once by ``init_dummy_weights`` (256 MiB of float32).
_DUMMY_SLAB_ELEMENTS = 1 << 26


@torch.no_grad()
def init_dummy_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights of the real shapes: matrices ~ N(0, 1/fan_in), vectors (norms, biases) ~ 1 + N(0, 0.1²);
    block-FP8 projections' scales shared by aligned groups of ``block`` rows, as a checkpoint's square
    tiles share them."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for param in model.parameters():
        mean, std = (0.0, param.shape[-1] ** -0.5) if param.dim() >= 2 else (1.0, 0.1)
        if param.element_size() > 1:
            param.normal_(mean, std, generator=gen)
            continue
        # float8 weights have no sampler of their own: drawn in float32 and cast, a slab of rows at a
        # time, so the draw never needs 4x a (256-expert) weight's bytes at once (a 4-layer DeepSeek-V3
        # in FP8 blocks ran out of an H100's 80 GB drawing one expert stack whole).
        rows = param.view(-1, param.shape[-1]) if param.dim() >= 2 else param.view(1, -1)
        for slab in rows.split(max(1, _DUMMY_SLAB_ELEMENTS // rows.shape[1])):
            slab.copy_(torch.empty_like(slab, dtype=torch.float32).normal_(mean, std, generator=gen))
    for module in model.modules():
        if isinstance(module, BlockFP8Weight):  # as a checkpoint's tiles: aligned groups of rows share scales
            scale, block = module.scale, module.block
            scale.copy_(row_scales(scale[::block], block, 0, scale.shape[0]))
