"""Hydra composition and pydantic validation of the shipped configs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from pegainfer.config.compose import (
    build_engine_config,
    build_prompt_config,
    build_sampling_params,
    compose,
)
from pegainfer.config.schema import EngineConfig, ModelConfig
from pegainfer.errors import ConfigError
from pegainfer.plugins.registry import get_model_registry
from pegainfer.sampling.sampling_params import SamplingParams


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_defaults_match_the_pydantic_defaults(command: str) -> None:
    cfg = compose(command)
    assert OmegaConf.is_struct(cfg)
    assert cfg.model.name == "auto" and cfg.model.path is None
    # The YAML mirrors EngineConfig: every key, and the same default values.
    assert build_engine_config(cfg) == EngineConfig()
    assert not GlobalHydra.instance().is_initialized()


def test_serve_has_a_server_section() -> None:
    server = compose("serve").server
    assert (server.host, server.port, server.api_key) == ("127.0.0.1", 8000, None)


def test_tp_alias_sets_the_tensor_parallel_size() -> None:
    assert build_engine_config(compose("generate", ["tp=2"])).parallel.tensor_parallel_size == 2


def test_overrides_reach_the_engine_config() -> None:
    config = build_engine_config(
        compose(
            "generate",
            ["scheduler.max_num_seqs=4", "cache.block_size=32", "device=cpu", "enforce_eager=true"],
        )
    )
    assert (config.scheduler.max_num_seqs, config.cache.block_size, config.device, config.enforce_eager) == (
        4,
        32,
        "cpu",
        True,
    )


@pytest.mark.parametrize("name", ["qwen3_14b", "qwen35", "deepseek"])
def test_each_plugin_contributes_a_model_option(name: str) -> None:
    cfg = compose("generate", [f"model={name}", "model.max_model_len=2048"])
    schema = get_model_registry().get(name).load_config_schema()
    # The plugin's YAML lists exactly its schema's keys, with the schema's defaults.
    assert set(cfg.model) == set(schema.model_fields)
    config = build_engine_config(cfg).model
    assert isinstance(config, schema)
    assert config == schema(name=name, max_model_len=2048)


def test_unknown_key_is_named_with_a_suggestion() -> None:
    with pytest.raises(ConfigError) as info:
        compose("generate", ["scheduler.max_num_seq=4"])
    assert (
        str(info.value)
        == "unknown config key 'scheduler.max_num_seq' (did you mean 'scheduler.max_num_seqs'?)"
    )


def test_unknown_model_option_lists_the_available_ones() -> None:
    with pytest.raises(
        ConfigError, match="unknown model 'llama'; available: auto, deepseek, deepseek_v4, qwen35, qwen3_14b"
    ):
        compose("generate", ["model=llama"])


def test_unknown_command_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown command 'bench'"):
        compose("bench")


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("cache.block_size=0", "cache.block_size"),
        ("scheduler.max_num_seqs=many", "scheduler.max_num_seqs"),
        ("device=tpu", "device"),
        ("model.dtype=int4", "model.dtype"),
        ("tp=0", "parallel.tensor_parallel_size"),
        ("+scheduler.chunk=8", "scheduler.chunk"),
    ],
)
def test_bad_engine_values_name_the_key(override: str, key: str) -> None:
    with pytest.raises(ConfigError, match=f"'{key}'"):
        build_engine_config(compose("generate", [override]))


def test_missing_and_unresolvable_values_name_the_key() -> None:
    with pytest.raises(ConfigError, match="'cache.block_size' has no value"):
        build_engine_config(compose("generate", ["cache.block_size=???"]))
    with pytest.raises(ConfigError, match="cannot resolve config key 'tp'"):
        build_engine_config(compose("generate", ["tp=${nope}"]))


def test_unknown_model_name_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown model 'llama'"):
        build_engine_config(compose("generate", ["model.name=llama"]))


def write_config(folder: Path, **config: object) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_auto_resolves_the_plugin_from_config_json(tmp_path: Path) -> None:
    folder = write_config(
        tmp_path / "ckpt", architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3"
    )
    model = build_engine_config(compose("generate", [f"model.path={folder}"])).model
    assert (model.name, model.path) == ("deepseek", str(folder))


def test_auto_without_a_path_stays_auto() -> None:
    assert build_engine_config(compose("generate")).model == ModelConfig()


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda root: root / "missing", "is not a folder"),
        (lambda root: root, "has no config.json"),
        (lambda root: write_config(root / "llama", architectures=["LlamaForCausalLM"]), "LlamaForCausalLM"),
    ],
)
def test_bad_checkpoint_paths_are_config_errors(tmp_path: Path, make, match: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match=match):
        build_engine_config(compose("generate", [f"model.path={make(tmp_path)}"]))


def test_sampling_defaults_and_overrides() -> None:
    params = build_sampling_params(compose("generate"))
    assert (params.temperature, params.max_tokens, params.seed, params.stop) == (0.0, 64, None, [])
    params = build_sampling_params(
        compose("generate", ["temperature=0.7", "top_k=0", "max_tokens=8", "stop=[END,'###']", "n=2"])
    )
    assert params == SamplingParams(temperature=0.7, top_k=-1, max_tokens=8, stop=["END", "###"], n=2)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("temperature=-1", "temperature"),
        ("temperature=hot", "temperature"),
        ("top_p=0", "top_p"),
        ("max_tokens=0", "max_tokens"),
        ("stop=['']", "stop"),
        ("ignore_eos=maybe", "ignore_eos"),
    ],
)
def test_bad_sampling_values_name_the_key(override: str, key: str) -> None:
    with pytest.raises(ConfigError, match=f"invalid value for '{key}'"):
        build_sampling_params(compose("generate", [override]))


def test_prompts() -> None:
    assert build_prompt_config(compose("generate")).all_prompts == ["The capital of France is"]
    config = build_prompt_config(compose("generate", ["prompts=[Hello,Bonjour]", "chat=true"]))
    assert (config.all_prompts, config.chat) == (["Hello", "Bonjour"], True)
    assert build_prompt_config(compose("generate", ["prompt=42"])).all_prompts == ["42"]
    with pytest.raises(ConfigError, match="'prompt'"):
        build_prompt_config(compose("generate", ["prompt=''"]))
    with pytest.raises(ConfigError, match="'prompts'"):
        build_prompt_config(compose("generate", ["prompts=[]"]))
