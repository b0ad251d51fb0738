"""`pegainfer generate tp=2` on the CPU, with the ranks the engine starts itself and with ranks `torchrun`
starts (its env:// rendezvous; rank 0 runs the command, rank 1 a worker): the text of one rank."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ARGS = ("device=cpu", "model.dtype=float32", "max_tokens=12", "cache.cpu_kv_cache_bytes=16777216")


def _pegainfer() -> str:
    script = Path(sys.executable).with_name("pegainfer")
    found = str(script) if script.exists() else shutil.which("pegainfer")
    assert found, "the `pegainfer` console script is not installed: pip install -e ."
    return found


def _run(command: list[str], cache: Path, model: str, *overrides: str) -> str:
    env = {**os.environ, "PEGAINFER_CACHE": str(cache)}
    done = subprocess.run(
        [*command, "generate", *ARGS, f"model={model}", *overrides],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    return done.stdout


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pegainfer-cache")


@pytest.mark.parametrize("model", ["qwen3_14b", "qwen35", "deepseek"])
def test_generate_tp2_gives_the_one_rank_text(cache, model):
    one = _run([_pegainfer()], cache, model)
    assert one.strip()
    assert _run([_pegainfer()], cache, model, "tp=2") == one


def test_torchrun_launch_gives_the_one_rank_text(cache):
    one = _run([_pegainfer()], cache, "qwen3_14b")
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        _pegainfer(),
    ]
    assert _run(torchrun, cache, "qwen3_14b", "tp=2") == one


def test_deepseek_v4_demo_runs_and_refuses_two_ranks_saying_why(cache):
    assert _run([_pegainfer()], cache, "deepseek_v4").strip()
    env = {**os.environ, "PEGAINFER_CACHE": str(cache)}
    refused = subprocess.run(
        [_pegainfer(), "generate", *ARGS, "model=deepseek_v4", "tp=2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert (
        refused.stderr.startswith("error: ") and "tp" in refused.stderr and "Traceback" not in refused.stderr
    )
