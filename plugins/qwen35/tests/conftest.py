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
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

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


@pytest.fixture(scope="session")
def aligned_qwen35(tiny_qwen35: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint (its embeddings unit-scale already) made nearly a bigram model, every mixer's and
    FFN's output projection scaled by 0.1 so the next token depends mostly on the current one, whose MTP
    module is that bigram: ``fc`` reads only the normed embedding and ``mtp.norm`` is the final norm."""
    folder = Path(shutil.copytree(tiny_qwen35, tmp_path_factory.mktemp("aligned") / "ckpt"))
    tensors = load_file(str(folder / "model.safetensors"))
    for name in list(tensors):
        if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
            tensors[name] = tensors[name] * 0.1
    h = tensors["mtp.norm.weight"].shape[0]
    tensors["mtp.fc.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
    tensors["mtp.pre_fc_norm_embedding.weight"] = torch.zeros(h)  # zero-centred: a plain RMSNorm
    tensors["mtp.norm.weight"] = tensors["model.language_model.norm.weight"].clone()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder
