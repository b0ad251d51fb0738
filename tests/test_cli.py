"""The `pegainfer` CLI: in-process for the argument paths, through the real console script for the rest."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pegainfer.cli import main


def console_script() -> str:
    """The `pegainfer` script of the interpreter running the tests (not whatever is first on PATH)."""
    script = Path(sys.executable).with_name("pegainfer")
    found = str(script) if script.exists() else shutil.which("pegainfer")
    assert found, "the `pegainfer` console script is not installed: pip install -e ."
    return found


def run_cli(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [console_script(), *args],
        cwd=cwd,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture()
def demo_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Keeps the embedded demo checkpoint out of the user's cache; shared so it is written once."""
    cache = tmp_path_factory.getbasetemp() / "pegainfer-cache"
    monkeypatch.setenv("PEGAINFER_CACHE", str(cache))
    return cache


def test_help_and_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    assert "pegainfer <command>" in capsys.readouterr().out
    assert main([]) == 2
    assert "usage:" in capsys.readouterr().err
    assert main(["bogus"]) == 2
    assert capsys.readouterr().err.startswith("error: unknown command 'bogus'\nusage:")


def test_models_lists_the_in_tree_plugins(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plugins"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["MODEL", "ARCHITECTURES", "PLUGIN", "PACKAGE"]
    rows = {line.split()[0]: line.split() for line in lines[1:] if line.strip()}
    assert rows["qwen3_14b"] == ["qwen3_14b", "Qwen3ForCausalLM", "qwen3_14b", "pegainfer-qwen3-14b"]
    assert {"qwen35", "deepseek"} <= set(rows)
    assert main(["models", "extra"]) == 2


def test_cfg_job_prints_the_composed_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--cfg", "job", "tp=2", "model=qwen35"]) == 0
    out = capsys.readouterr().out
    assert "tp: 2" in out and "tensor_parallel_size: ${tp}" in out and "name: qwen35" in out
    assert "hydra:" not in out


def test_generate_help_lists_the_model_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["generate", "--help"])
    assert info.value.code == 0
    assert "model: auto, deepseek, deepseek_v4, qwen35, qwen3_14b" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["scheduler.max_num_seq=4"],
            "unknown config key 'scheduler.max_num_seq' (did you mean 'scheduler.max_num_seqs'?)",
        ),
        (["model=llama"], "unknown model 'llama'; available: auto"),
        (["temperature=-1"], "invalid value for 'temperature': temperature must be in [0, 100]"),
        (["cache.block_size=0"], "invalid value for 'cache.block_size'"),
        (["-m", "temperature=0,1"], "pegainfer generate does not support --multirun"),
    ],
)
def test_config_errors_print_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    assert main(["generate", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"error: {message}")
    assert captured.err.count("\n") == 1, captured.err


def test_generate_prints_each_completion(capsys: pytest.CaptureFixture[str], demo_cache: Path) -> None:
    assert (
        main(
            [
                "generate",
                "device=cpu",
                "chat=true",
                "prompts=[Hi,Hello]",
                "max_tokens=2",
                "n=2",
                "temperature=1",
            ]
        )
        == 0
    )
    headers = [line for line in capsys.readouterr().out.splitlines() if line.startswith("--- prompt")]
    assert headers == [f"--- prompt {p}, completion {c} ---" for p in (0, 1) for c in (0, 1)]


def test_console_script_reports_a_typo_in_one_line(tmp_path: Path) -> None:
    result = run_cli("generate", "scheduler.max_num_seq=4", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr == (
        "error: unknown config key 'scheduler.max_num_seq' (did you mean 'scheduler.max_num_seqs'?)\n"
    )
    assert list(tmp_path.iterdir()) == []


def test_console_script_generates_with_no_arguments_and_writes_nothing_here(
    tmp_path: Path, demo_cache: Path
) -> None:
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    result = run_cli("generate", cwd=workdir, env={"PEGAINFER_CACHE": str(demo_cache)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert "Traceback" not in result.stderr
    # No Hydra output folders, logs or .hydra dirs in the working directory.
    assert list(workdir.iterdir()) == []
