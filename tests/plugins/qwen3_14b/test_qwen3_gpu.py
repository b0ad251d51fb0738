"""The Qwen3 reference path on a CUDA GPU in bf16 against HF transformers bf16 (``nox -s gpu``, not CI).

Gate: over teacher-forced positions, the mean absolute difference of the log-probabilities of the
reference's top tokens is <= 0.06 and its 99th percentile <= 0.2 (bf16 rounding differs between the two
implementations; a real bug shows as differences of whole nats).
"""

from __future__ import annotations

import random

import pytest
import torch

from pegainfer import LLM
from pegainfer.executor import ModelBatch, SequenceChunk
from pegainfer.request import Request
from pegainfer.sampling_params import SamplingParams
from pegainfer.testing.conformance import hf_logits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _logprob_gap(ours: torch.Tensor, ref: torch.Tensor, k: int = 8) -> torch.Tensor:
    ours, ref = torch.log_softmax(ours.float(), -1), torch.log_softmax(ref.float(), -1)
    top = ref.topk(k, dim=-1).indices
    return (ours.gather(-1, top) - ref.gather(-1, top)).abs().flatten()


@pytest.mark.parametrize("batched", [False, True], ids=["batch1", "batched"])
def test_bf16_logits_match_hf_bf16(tiny_checkpoint_factory, batched):
    folder = tiny_checkpoint_factory(
        "qwen3",
        seed=3,
        dtype="bfloat16",
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
    )
    llm = LLM(str(folder), dtype="bfloat16", device="cuda", gpu_memory_utilization=0.3, max_model_len=1024)
    engine = llm.engine
    rng = random.Random(0)
    prompts = [[rng.randrange(990) for _ in range(n)] for n in (97, 64, 150, 33)]
    if not batched:
        prompts = prompts[:1]
    chunks, requests = [], []
    for i, prompt in enumerate(prompts):
        request = Request(f"r{i}", prompt, SamplingParams())
        assert engine.buffers.allocate_slots(request, len(prompt))
        requests.append(request)
        chunks.append(SequenceChunk(f"r{i}", prompt, 0, engine.buffers.block_table(f"r{i}"), all_logits=True))
    out = engine.executor.execute(ModelBatch(chunks))
    gaps = []
    for i, prompt in enumerate(prompts):
        ref = hf_logits(folder, prompt, dtype=torch.bfloat16, device="cuda")
        gaps.append(_logprob_gap(out.all_logits[f"r{i}"], ref))
    for request in requests:
        engine.buffers.free(request)
    gap = torch.cat(gaps)
    mean, p99 = gap.mean().item(), gap.quantile(0.99).item()
    print(f"positions={sum(map(len, prompts))} mean|dlogp|={mean:.4f} p99={p99:.4f}")
    assert mean <= 0.06 and p99 <= 0.2
