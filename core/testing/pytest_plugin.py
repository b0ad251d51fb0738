"""pytest plugin shipped with pegainfer (entry point ``pytest11``): fixtures a plugin author reuses.

Imports stay lazy so that loading this plugin costs nothing in test runs that do not use it.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(autouse=True)
def _release_gpu_memory(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a ``gpu``-marked test, collect what it left in reference cycles (an engine's parts refer to
    each other) and hand the freed blocks back to the driver: the next test's memory plan sizes its pages
    from the memory free then, and on an 80 GB card engines left by earlier tests in the same process ran
    the next one out of memory (docs/gpu-checks.md, thirty-first session)."""
    yield
    if request.node.get_closest_marker("gpu") is None:
        return
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        gc.collect()
        torch.cuda.empty_cache()


@pytest.fixture(scope="session")
def tiny_checkpoint_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``factory(architecture="qwen3", **options)`` writes a tiny random checkpoint once per option set."""
    from pegainfer.testing.checkpoints import write_tiny_checkpoint

    made: dict[str, Path] = {}

    def factory(architecture: str = "qwen3", **options: Any) -> Path:
        key = f"{architecture}-{sorted(options.items())!r}"
        if key not in made:
            folder = tmp_path_factory.mktemp(f"ckpt-{architecture}")
            made[key] = write_tiny_checkpoint(folder, architecture, **options)
        return made[key]

    return factory


@pytest.fixture(scope="session")
def tiny_qwen3(tiny_checkpoint_factory: Callable[..., Path]) -> Path:
    """A tiny random Qwen3 checkpoint (float32, untied embeddings)."""
    return tiny_checkpoint_factory("qwen3")


@pytest.fixture(scope="class")
def conformance_checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint of a ``PluginConformance`` subclass (its ``make_checkpoint``), once per class."""
    suite = request.cls
    return suite.make_checkpoint(tmp_path_factory.mktemp(f"conformance-{suite.model_name}"))


@pytest.fixture(scope="class")
def conformance_llm(request: pytest.FixtureRequest, conformance_checkpoint: Path) -> Any:
    """An LLM of the suite's model on the CPU in float32, built through the Hydra config like the CLI."""
    from pegainfer.config.compose import build_engine_config, compose
    from pegainfer.engine.llm import LLM

    overrides = [
        f"model={request.cls.model_name}",
        f"model.path={conformance_checkpoint}",
        "device=cpu",
        "model.dtype=float32",
        "cache.cpu_kv_cache_bytes=8388608",
    ]
    return LLM.from_config(build_engine_config(compose("generate", overrides)))
