"""Hydra composes the configuration, pydantic validates it.

The primary configs (``generate``, ``serve``) live in ``pegainfer.conf``; plugins add ``model/<name>.yaml``
options through ``register_config_dirs``, which reach Hydra through one core-owned search-path plugin,
so the CLI (``hydra.main``) and the compose API see the same options. Every failure becomes a one-line
``ConfigError`` that names the key.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra import compose as hydra_compose
from hydra import initialize_config_module
from hydra.core.config_search_path import ConfigSearchPath
from hydra.core.global_hydra import GlobalHydra
from hydra.core.plugins import Plugins
from hydra.errors import HydraException, MissingConfigException
from hydra.plugins.search_path_plugin import SearchPathPlugin
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    MissingMandatoryValue,
    OmegaConfBaseException,
)
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from pegainfer.config.schema import EngineConfig, ModelConfig, validate_section
from pegainfer.errors import ConfigError, RequestError
from pegainfer.model import checkpoint as loader
from pegainfer.plugins.registry import config_search_path, get_model_registry
from pegainfer.sampling.sampling_params import SamplingParams

CONFIG_MODULE = "pegainfer.conf"
HYDRA_VERSION_BASE = "1.3"
COMMANDS = ("generate", "serve")


class PluginConfigDirs(SearchPathPlugin):
    """Appends the plugins' config dirs after ours, so a plugin adds options but cannot replace core files."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        for path in config_search_path():
            search_path.append(provider="pegainfer-plugins", path=path)


def install_search_path() -> None:
    """Register the search-path plugin with Hydra (idempotent); done before any composition."""
    Plugins.instance().register(PluginConfigDirs)


def compose(command: str, overrides: Sequence[str] = ()) -> DictConfig:
    """Compose the primary config of ``command`` with Hydra overrides (``key=value``), in struct mode.

    Hydra's global state is cleared before and after, so calls (and tests) do not leak into each other.
    A bad override is a ConfigError naming the key.
    """
    if command not in COMMANDS:
        raise ConfigError(f"unknown command '{command}'; the configs are: {', '.join(COMMANDS)}")
    install_search_path()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module=CONFIG_MODULE, version_base=HYDRA_VERSION_BASE):
            return hydra_compose(config_name=command, overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as exc:
        raise hydra_error(exc) from None
    finally:
        GlobalHydra.instance().clear()


def hydra_error(exc: BaseException) -> ConfigError:
    """Turn a Hydra/OmegaConf composition error into a one-line ConfigError."""
    if isinstance(exc, MissingConfigException) and exc.missing_cfg_file and exc.options is not None:
        group, _, option = exc.missing_cfg_file.rpartition("/")
        message = f"unknown {group or 'config'} '{option}'; available: {', '.join(exc.options) or 'none'}"
        failures = get_model_registry().failures_note() if group == "model" else ""
        if failures:
            message += f"; {failures}"
        return ConfigError(message)
    cause = exc if isinstance(exc, OmegaConfBaseException) else exc.__cause__
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and cause.full_key:
        message = f"unknown config key '{cause.full_key}'"
        parent = cause.parent_node
        if isinstance(parent, DictConfig) and isinstance(cause.key, str):
            close = difflib.get_close_matches(cause.key, [str(k) for k in parent.keys()], n=1)
            if close:
                prefix = cause.full_key[: -len(cause.key)]
                message += f" (did you mean '{prefix}{close[0]}'?)"
        return ConfigError(message)
    text = str(exc) if exc.__cause__ is None else f"{exc} {exc.__cause__}"
    return ConfigError(" ".join(text.split()))


def to_container(cfg: DictConfig) -> dict[str, Any]:
    """Resolve interpolations into plain Python data; a missing (``???``) or broken value names its key."""
    try:
        data = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as exc:
        key = exc.full_key or "?"
        if isinstance(exc, MissingMandatoryValue):
            raise ConfigError(f"config key '{key}' has no value; set it with {key}=VALUE") from None
        reason = str(exc.msg or exc).splitlines()[0]
        raise ConfigError(f"cannot resolve config key '{key}': {reason}") from None
    assert isinstance(data, dict)
    return {str(k): v for k, v in data.items()}


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """Parse a checkpoint folder's ``config.json``; a wrong ``model.path`` is a ConfigError naming the key."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ConfigError(f"model.path '{path}' is not a folder; give a Hugging Face checkpoint folder")
    if not (folder / "config.json").is_file():
        raise ConfigError(f"model.path '{path}' has no config.json; give a Hugging Face checkpoint folder")
    return loader.read_hf_config(folder)


def build_model_config(section: Any) -> ModelConfig:
    """Validate the ``model`` section with the chosen plugin's schema.

    ``name: auto`` picks the plugin from ``path``'s config.json (no path: stays ``auto``, the embedded
    demo checkpoint); any other name is looked up in the registry.
    """
    if not isinstance(section, dict):
        raise ConfigError(f"config key 'model' must be a section, got {section!r}")
    section = dict(section)
    if isinstance(section.get("path"), str):
        section["path"] = str(Path(section["path"]).expanduser())
    name = section.get("name", "auto")
    if name == "auto":
        if section.get("path") is None:
            return validate_section(ModelConfig, section, "model")
        registration = get_model_registry().resolve(read_hf_config(section["path"]))
        section["name"] = registration.name
    else:
        registration = get_model_registry().get(str(name))
    return validate_section(registration.load_config_schema(), section, "model")


def build_engine_config(cfg: DictConfig) -> EngineConfig:
    """The validated EngineConfig of a composed config (keys outside EngineConfig, e.g. ``tp``, are ignored)."""
    data = to_container(cfg)
    engine = {key: data[key] for key in EngineConfig.model_fields if key in data}
    engine["model"] = build_model_config(engine.get("model", {}))
    return validate_section(EngineConfig, engine, "")


# ``seed`` is the engine's (EngineConfig.seed, which seeds the sampler); eos ids come from the checkpoint.
_SAMPLING_KEYS = [
    f.name for f in dataclasses.fields(SamplingParams) if f.name not in ("seed", "eos_token_ids")
]


def build_sampling_params(cfg: DictConfig) -> SamplingParams:
    """SamplingParams from the top-level sampling keys (``temperature``, ``max_tokens``, ``stop``...)."""
    data = to_container(cfg)
    hints = typing.get_type_hints(SamplingParams)
    kwargs = {}
    for key in _SAMPLING_KEYS:
        if key in data:
            try:
                kwargs[key] = TypeAdapter(hints[key]).validate_python(data[key])
            except ValidationError as exc:
                got = data[key]
                raise ConfigError(
                    f"invalid value for '{key}': {exc.errors()[0]['msg']} (got {got!r})"
                ) from None
    try:
        return SamplingParams(**kwargs)
    except RequestError as exc:
        raise ConfigError(f"invalid value for '{exc.param or 'sampling'}': {exc}") from None


class PromptConfig(BaseModel):
    """What ``generate`` feeds the model: ``prompts`` when set, else ``prompt``."""

    model_config = ConfigDict(frozen=True, coerce_numbers_to_str=True)

    prompt: str = Field(min_length=1)
    prompts: list[str] | None = Field(default=None, min_length=1)
    chat: bool = False

    @property
    def all_prompts(self) -> list[str]:
        return list(self.prompts) if self.prompts is not None else [self.prompt]


def build_prompt_config(cfg: DictConfig) -> PromptConfig:
    """The validated prompt keys of a ``generate`` config."""
    data = to_container(cfg)
    return validate_section(PromptConfig, {k: data[k] for k in PromptConfig.model_fields if k in data}, "")


def build_server_config(cfg: DictConfig) -> Any:
    """The validated ``server`` section of a ``serve`` config (a ``pegainfer.server.config.ServerConfig``)."""
    from pegainfer.server.config import ServerConfig

    data = to_container(cfg)
    return validate_section(ServerConfig, data.get("server") or {}, "server")
