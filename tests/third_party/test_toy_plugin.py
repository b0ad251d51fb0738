"""The third-party plugin path end to end, with the installed `pegainfer-toy-plugin` (tests/fake_plugin).

The toy is written against pegainfer's public plugin API alone and brings its own tiny checkpoint, so it
runs with no in-tree plugin installed (the nox `third_party` session installs only it and the broken
plugin). transformers' Qwen3 is its reference, on a relabelled copy of its checkpoint.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "pegainfer_toy", reason="the toy plugin is not installed: pip install -e tests/fake_plugin"
)

import pegainfer_toy  # noqa: E402
from pegainfer.config.compose import build_engine_config, compose  # noqa: E402
from pegainfer.errors import CheckpointError, ConfigError  # noqa: E402
from pegainfer.model.checkpoint import CheckpointReader  # noqa: E402
from pegainfer.plugins.registry import get_model_registry, reset_plugins  # noqa: E402
from pegainfer.plugins.tiny_checkpoints import write_tiny_checkpoint  # noqa: E402
from pegainfer.sampling.sampling_params import SamplingParams  # noqa: E402
from pegainfer.testing.conformance import relabelled_checkpoint  # noqa: E402
from pegainfer.testing.suite import PluginConformance  # noqa: E402
from pegainfer_toy.config import ToyQwen3Config  # noqa: E402

IN_TREE_PLUGINS = ("pegainfer_qwen3_14b", "pegainfer_qwen35", "pegainfer_deepseek")


@pytest.fixture(autouse=True)
def fresh_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PEGAINFER_PLUGINS", raising=False)
    monkeypatch.delenv("PEGAINFER_DISABLE_PLUGINS", raising=False)
    reset_plugins()


def as_qwen3(folder: Path, target: Path, edit: Callable[[dict[str, Any]], None] | None = None) -> Path:
    """What transformers loads as the toy's reference: ``folder`` labelled as its Qwen3."""
    return relabelled_checkpoint(folder, target, "Qwen3ForCausalLM", "qwen3", edit)


@pytest.fixture(scope="module")
def toy_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("toy"), "toy_qwen3")


class TestToyConformance(PluginConformance):
    """The suite any plugin runs with one subclass, against transformers and on two ranks."""

    model_name = "toy_qwen3"
    architecture = "toy_qwen3"  # the toy's own tiny builder (register_tiny_checkpoints)
    hf_reference = True
    tensor_parallel_size = 2

    @classmethod
    def reference_checkpoint(cls, folder: Path) -> Path:
        return as_qwen3(folder, folder.with_name(folder.name + "-as-qwen3"))

    @pytest.mark.parametrize(("key", "default"), [("rms_norm_eps", 1e-6), ("rope_theta", 10000.0)])
    def test_a_loader_ignoring_a_config_value_would_fail(
        self, conformance_llm: Any, conformance_checkpoint: Path, key: str, default: float
    ) -> None:
        """The tiny config departs from transformers' defaults: transformers run with the default instead
        is far outside the logits tolerance from our model, so the logits check above reads each value."""
        from pegainfer.testing.conformance import hf_logits, relative_error, teacher_forced_logits

        def reset(config: dict[str, Any]) -> None:
            where = config["rope_parameters"] if key == "rope_theta" else config
            assert where[key] != default
            where[key] = default

        folder = conformance_checkpoint
        reference = as_qwen3(folder, folder.with_name(f"{folder.name}-default-{key}"), reset)
        tokens = list(range(3, 33))
        ours = teacher_forced_logits(conformance_llm, tokens, prefill=len(tokens))
        assert relative_error(ours, hf_logits(reference, tokens)) > 10 * self.logits_tolerance


def test_tied_embeddings_match_transformers(tmp_path: Path) -> None:
    """A tied checkpoint (no lm_head tensor) reads its logits through the embedding table."""
    from pegainfer.engine.llm import LLM
    from pegainfer.testing.conformance import hf_logits, relative_error, teacher_forced_logits

    folder = write_tiny_checkpoint(tmp_path / "tied", "toy_qwen3", tie_word_embeddings=True)
    assert "lm_head.weight" not in CheckpointReader(folder)
    llm = LLM(str(folder), device="cpu", dtype="float32", cpu_kv_cache_bytes=4 << 20)
    tokens = list(range(5, 25))
    ours = teacher_forced_logits(llm, tokens, prefill=12)
    assert relative_error(ours, hf_logits(as_qwen3(folder, tmp_path / "ref"), tokens)) < 1e-4


@pytest.mark.parametrize(
    ("key", "value"), [("attention_bias", True), ("use_sliding_window", True), ("hidden_act", "gelu")]
)
def test_qwen3_options_the_toy_lacks_are_refused_naming_them(key: str, value: Any) -> None:
    import torch

    from pegainfer_toy.model import ToyQwen3ForCausalLM
    from pegainfer_toy.tiny import toy_qwen3_config

    config = toy_qwen3_config(1024, **{key: value})
    with pytest.raises(CheckpointError, match=f"{key}=.* is not supported by ToyQwen3"):
        ToyQwen3ForCausalLM.from_hf_config(config, ToyQwen3Config(), dtype=torch.float32, max_model_len=64)


def test_the_toy_imports_only_the_public_api() -> None:
    """Every import in the toy's package, lazy ones included: no in-tree plugin, no test helpers."""
    forbidden = (*IN_TREE_PLUGINS, "pegainfer.testing")
    found = []
    for path in Path(pegainfer_toy.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            found += [f"{path.name}: {n}" for n in names if n.startswith(forbidden)]
    assert found == []


def test_the_toy_runs_with_no_other_plugin_loaded(tmp_path: Path) -> None:
    """With only the toy's entry point loaded, in a fresh process: its tiny builder writes the checkpoint
    and it generates, and no in-tree plugin module was imported on the way."""
    script = f"""
import sys
from pegainfer.engine.llm import LLM
from pegainfer.plugins.registry import get_model_registry
from pegainfer.sampling.sampling_params import SamplingParams
from pegainfer.plugins.tiny_checkpoints import write_tiny_checkpoint

assert [r.name for r in get_model_registry().registrations()] == ["toy_qwen3"]
folder = write_tiny_checkpoint({str(tmp_path / "ckpt")!r}, "toy_qwen3")
llm = LLM(str(folder), device="cpu", cpu_kv_cache_bytes=4 << 20)
(out,) = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
assert len(out.outputs[0].token_ids) == 3
print(sorted(m for m in sys.modules if m.startswith({IN_TREE_PLUGINS!r} + ("pegainfer.testing",))))
"""
    env = {**os.environ, "PEGAINFER_PLUGINS": "toy"}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def run_cli(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).with_name("pegainfer")
    return subprocess.run(
        [str(script), *args], cwd=cwd, capture_output=True, text=True, timeout=300, env={**os.environ, **env}
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


def test_model_option_without_a_path_runs_the_toys_demo(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pegainfer.engine.llm import LLM

    monkeypatch.setenv("PEGAINFER_CACHE", str(tmp_path))
    llm = LLM.from_config(build_engine_config(compose("generate", ["model=toy_qwen3", "device=cpu"])))
    (output,) = llm.generate(["Hi"], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 3
    (demo,) = tmp_path.glob("demo-toy_qwen3-*")
    assert json.loads((demo / "config.json").read_text())["architectures"] == ["ToyQwen3ForCausalLM"]


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
