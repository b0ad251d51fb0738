"""The third-party plugin path end to end, with the installed `pegainfer-toy-plugin` (tests/fake_plugin).

Run by the nox `third_party` session, which installs it (and the broken plugin); skipped when absent.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip(
    "pegainfer_toy", reason="the toy plugin is not installed: pip install -e tests/fake_plugin"
)

from pegainfer.config.compose import build_engine_config, compose  # noqa: E402
from pegainfer.errors import ConfigError  # noqa: E402
from pegainfer.plugins.registry import get_model_registry, reset_plugins  # noqa: E402
from pegainfer.sampling.sampling_params import SamplingParams  # noqa: E402
from pegainfer.testing.suite import PluginConformance  # noqa: E402
from pegainfer_toy.config import ToyQwen3Config  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PEGAINFER_PLUGINS", raising=False)
    monkeypatch.delenv("PEGAINFER_DISABLE_PLUGINS", raising=False)
    reset_plugins()


def write_toy_checkpoint(folder: Path) -> Path:
    """A tiny Qwen3 checkpoint relabelled as the toy architecture."""
    from pegainfer.testing.checkpoints import write_tiny_checkpoint

    folder = write_tiny_checkpoint(folder, architecture="qwen3")
    config = json.loads((folder / "config.json").read_text())
    config.update(architectures=["ToyQwen3ForCausalLM"], model_type="toy_qwen3")
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def toy_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_toy_checkpoint(tmp_path_factory.mktemp("toy"))


class TestToyConformance(PluginConformance):
    """The suite any plugin runs with one subclass; transformers cannot load the toy architecture."""

    model_name = "toy_qwen3"
    hf_reference = False
    tensor_parallel_size = 0  # its from_hf_config takes no tp: refused, which the suite checks

    @classmethod
    def make_checkpoint(cls, folder: Path) -> Path:
        return write_toy_checkpoint(folder)


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).with_name("pegainfer")
    return subprocess.run(
        [str(script), *args], cwd=cwd, capture_output=True, text=True, timeout=300, env=os.environ
    )


def test_toy_plugin_is_discovered() -> None:
    reg = get_model_registry().get("toy_qwen3")
    assert (reg.plugin, reg.package) == ("toy", "pegainfer-toy-plugin")
    assert reg.load_config_schema() is ToyQwen3Config
    assert get_model_registry().resolve({"model_type": "toy_qwen3"}).name == "toy_qwen3"


def test_console_script_lists_the_toy_model(tmp_path: Path) -> None:
    result = run_cli("models", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    row = next(line.split() for line in result.stdout.splitlines() if line.startswith("toy_qwen3"))
    assert row == ["toy_qwen3", "ToyQwen3ForCausalLM", "toy", "pegainfer-toy-plugin"]


def test_model_option_composes_the_plugins_yaml_and_schema(toy_checkpoint: Path) -> None:
    cfg = compose("generate", ["model=toy_qwen3", f"model.path={toy_checkpoint}", "model.logit_scale=2"])
    assert cfg.model.logit_scale == 2
    model = build_engine_config(cfg).model
    assert isinstance(model, ToyQwen3Config) and model.logit_scale == 2.0
    with pytest.raises(ConfigError, match="'model.logit_scale'"):
        build_engine_config(compose("generate", ["model=toy_qwen3", "model.logit_scale=0"]))


def test_auto_finds_the_toy_plugin_from_config_json(toy_checkpoint: Path) -> None:
    model = build_engine_config(compose("generate", [f"model.path={toy_checkpoint}"])).model
    assert isinstance(model, ToyQwen3Config) and (model.name, model.logit_scale) == ("toy_qwen3", 1.0)


def test_generation_applies_the_plugins_config_key(toy_checkpoint: Path) -> None:
    from pegainfer.engine.llm import LLM

    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=0)
    chosen = {}
    for scale in (1, 3):
        overrides = [
            "model=toy_qwen3",
            f"model.path={toy_checkpoint}",
            f"model.logit_scale={scale}",
            "device=cpu",
        ]
        llm = LLM.from_config(build_engine_config(compose("generate", overrides)))
        (output,) = llm.generate(["Hello world"], params, use_tqdm=False)
        completion = output.outputs[0]
        logprobs = [
            position[token].logprob
            for position, token in zip(completion.logprobs, completion.token_ids, strict=True)
        ]
        chosen[scale] = (completion.token_ids, logprobs)
    # Scaling the logits leaves greedy choices alone but makes the model more confident in them.
    assert chosen[1][0] == chosen[3][0]
    assert all(sharp > flat for flat, sharp in zip(chosen[1][1], chosen[3][1], strict=True))


def test_console_script_generates_with_the_toy_model(tmp_path: Path, toy_checkpoint: Path) -> None:
    result = run_cli(
        "generate", "model=toy_qwen3", f"model.path={toy_checkpoint}", "max_tokens=4", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert "loaded toy_qwen3" in result.stderr


def broken_plugin_installed() -> bool:
    try:
        importlib.metadata.distribution("pegainfer-broken-plugin")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(
    not broken_plugin_installed(), reason="pegainfer-broken-plugin is not installed (nox -s third_party)"
)
def test_an_installed_broken_plugin_is_named_and_the_others_keep_working(tmp_path: Path) -> None:
    result = run_cli("models", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert (
        "pegainfer plugin 'broken' (package pegainfer-broken-plugin) was skipped: import of" in result.stderr
    )
    assert "not-installed-anywhere" in result.stderr
    assert "broken (pegainfer-broken-plugin): import of pegainfer_broken.hooks failed" in result.stdout
    assert any(line.startswith("toy_qwen3") for line in result.stdout.splitlines())
    assert any(line.startswith("qwen3_14b") for line in result.stdout.splitlines())


def test_a_model_that_takes_no_tp_is_refused_at_tp2_naming_it(toy_checkpoint: Path) -> None:
    """The toy's from_hf_config predates tensor parallelism (no ``tp`` keyword): tp=2 is a clear error,
    tp=1 keeps working."""
    from pegainfer.engine.llm import LLM

    with pytest.raises(
        ConfigError, match="model 'toy_qwen3' from plugin .* does not support tensor parallelism"
    ):
        LLM(str(toy_checkpoint), device="cpu", cpu_kv_cache_bytes=4 << 20, tensor_parallel_size=2)
