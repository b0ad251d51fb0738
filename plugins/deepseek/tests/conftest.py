"""Fixtures of the DeepSeek plugin tests: a tiny V3 checkpoint (with MTP layer), its "aligned" copy whose
MTP layer drafts well, and a float32 LLM on the tiny checkpoint.

Without a GPU the plugin's Triton kernels run on CPU tensors through Triton's interpreter, which must be
chosen before Triton is first imported: ``TRITON_INTERPRET`` is set here (nothing else launches Triton
kernels off CUDA)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from pegainfer_deepseek.tiny import EMBED_STD  # noqa: E402


@pytest.fixture(scope="session")
def tiny_deepseek(tiny_checkpoint_factory: Callable[..., Path]) -> Path:
    """The default tiny DeepSeek-V3: q LoRA, 1 dense + 2 MoE layers, 4 expert groups, YaRN, one MTP layer."""
    return tiny_checkpoint_factory("deepseek_v3")


@pytest.fixture(scope="module")
def llm(tiny_deepseek: Path):
    from pegainfer import LLM

    return LLM(str(tiny_deepseek), dtype="float32", device="cpu", cpu_kv_cache_bytes=8 << 20)


@pytest.fixture(scope="session")
def aligned_deepseek(tiny_deepseek: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint made nearly a bigram model whose MTP layer drafts well (``aligned``)."""
    return aligned(tiny_deepseek, tmp_path_factory.mktemp("aligned") / "ckpt")


@pytest.fixture(scope="session")
def aligned_v32(
    tiny_checkpoint_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The same for a tiny DeepSeek-V3.2 with an MTP layer (its indexer included)."""
    folder = tiny_checkpoint_factory("deepseek_v32", num_nextn_predict_layers=1)
    return aligned(folder, tmp_path_factory.mktemp("aligned-v32") / "ckpt")


def aligned(source: Path, target: Path) -> Path:
    """A copy of ``source`` made nearly a bigram model (every o_proj and down projection scaled by 0.1, so
    the next token depends mostly on the current one) whose MTP layer is that bigram: it reads only the
    embedding half of ``eh_proj`` and shares the main embedding, final norm and head."""
    folder = Path(shutil.copytree(source, target))
    tensors = load_file(str(folder / "model.safetensors"))
    # Unit-scale embeddings (the tiny checkpoint's are small): the current token dominates the residual.
    tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"] / EMBED_STD
    for name in list(tensors):
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[name] = tensors[name] * 0.1
    mtp = f"model.layers.{json.loads((folder / 'config.json').read_text())['num_hidden_layers']}."
    h = tensors["model.norm.weight"].shape[0]
    tensors[mtp + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors[mtp + "enorm.weight"] = torch.ones(h)
    tensors[mtp + "eh_proj.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
    tensors[mtp + "shared_head.norm.weight"] = tensors["model.norm.weight"].clone()
    tensors[mtp + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, str(folder / "model.safetensors"))
    return folder
