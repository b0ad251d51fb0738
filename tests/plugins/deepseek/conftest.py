"""Fixtures of the DeepSeek plugin tests: a tiny V3 checkpoint (with MTP layer) and a float32 LLM on it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_deepseek(tiny_checkpoint_factory: Callable[..., Path]) -> Path:
    """The default tiny DeepSeek-V3: q LoRA, 1 dense + 2 MoE layers, 4 expert groups, YaRN, one MTP layer."""
    return tiny_checkpoint_factory("deepseek_v3")


@pytest.fixture(scope="module")
def llm(tiny_deepseek: Path):
    from pegainfer import LLM

    return LLM(str(tiny_deepseek), dtype="float32", device="cpu", cpu_kv_cache_bytes=8 << 20)
