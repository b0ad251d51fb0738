"""The tensor-parallel executor on one GPU: a one-rank NCCL group, so every collective the model and the
runner issue (vocab-parallel embedding and logits, row-parallel all-reduces, the carried tokens'
broadcast) is a real NCCL call, captured inside the decode CUDA graphs. Its tokens must equal the local
executor's exactly (a one-rank reduce changes no bit)."""

from __future__ import annotations

import pytest
import torch

import pegainfer.engine.llm_engine as engine_module
from pegainfer.config.compose import build_engine_config, compose
from pegainfer.engine.llm import LLM
from pegainfer.sampling.sampling_params import SamplingParams
from pegainfer.testing.checkpoints import write_tiny_checkpoint
from pegainfer.testing.conformance import random_prompts

pytestmark = pytest.mark.gpu


def _config(folder, *overrides):
    return build_engine_config(
        compose("generate", [f"model.path={folder}", "device=cuda", "model.dtype=bfloat16", *overrides])
    )


def test_one_rank_nccl_group_gives_the_local_tokens(tmp_path, monkeypatch):
    from pegainfer.executor.tp_executor import TensorParallelExecutor

    if not torch.distributed.is_nccl_available():
        pytest.skip("this torch has no NCCL")
    folder = write_tiny_checkpoint(
        tmp_path / "q3",
        "qwen3",
        dtype="bfloat16",
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=3,
    )
    prompts = random_prompts(1, [7, 30, 3, 12])
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    local = LLM.from_config(_config(folder))
    expected = [
        o.outputs[0].token_ids for o in local.generate(prompt_token_ids=prompts, sampling_params=params)
    ]
    del local
    monkeypatch.setattr(engine_module, "build_executor", TensorParallelExecutor)
    llm = LLM.from_config(_config(folder))
    try:
        executor = llm.engine.executor
        assert isinstance(executor, TensorParallelExecutor) and executor.capabilities.cuda_graphs
        assert type(executor.tp.group).__name__ == "ProcessGroupNCCL"
        assert llm.engine.async_scheduling
        got = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
        assert got == expected
    finally:
        llm.engine.shutdown()
