"""Shared fixtures of the Qwen3.5 tests.

When ``fla`` or ``causal_conv1d`` is importable, transformers binds their Triton/CUDA kernels into its
Qwen3.5 model at import time; without a GPU they fail with "0 active drivers". On a CPU machine they are
blocked before transformers' Qwen3.5 module is imported, so its torch fallbacks are the reference.

Without a GPU the plugin's Triton kernels (``gdn_kernels``) run on CPU tensors through Triton's
interpreter, which must be chosen before Triton is first imported: ``TRITON_INTERPRET`` is set here, as
``tests/kernels/conftest.py`` does (nothing else launches Triton kernels off CUDA).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    for _kernel_package in ("fla", "causal_conv1d"):
        sys.modules.setdefault(_kernel_package, None)  # type: ignore[assignment]

ARCHITECTURES = ["qwen3_5", "qwen3_5_moe"]


@pytest.fixture(scope="session", params=ARCHITECTURES, ids=["dense", "moe"])
def architecture(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="session")
def tiny_qwen35(tiny_checkpoint_factory: Callable[..., Path], architecture: str) -> Path:
    """A tiny random Qwen3.5 checkpoint (dense or MoE) in the published VLM layout, float32."""
    return tiny_checkpoint_factory(architecture)
