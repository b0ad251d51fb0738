"""The Qwen3 reference path on a CUDA GPU in bf16 against HF transformers (``nox -s gpu``, not CI).

Random weights make a chaotic network: bf16 rounding noise grows layer by layer, so two correct bf16
implementations disagree by more than they would on a trained model. The gate is therefore relative to
the truth: against HF in float32, our bf16 log-probabilities (of HF's top-8 tokens at every position)
must be no less accurate than HF's own bf16 ones (mean error within 25% + 0.01 nats), and the direct
bf16-vs-bf16 gap is reported beside it.
"""

from __future__ import annotations

import random

import pytest
import torch

from pegainfer import LLM
from pegainfer.engine.request import Request
from pegainfer.executor.executor import ModelBatch, SequenceChunk
from pegainfer.sampling.sampling_params import SamplingParams
from pegainfer.testing.conformance import Bf16AccuracyReport

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SHAPE = {
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
}


#: The engine settings of the decode-path comparisons (graph vs eager, PDL on vs off).
DECODE_LLM = dict(dtype="bfloat16", device="cuda", gpu_memory_utilization=0.3, max_model_len=512)


@pytest.fixture(scope="module")
def folder(tiny_checkpoint_factory):
    return tiny_checkpoint_factory("qwen3", seed=3, dtype="bfloat16", **SHAPE)


@pytest.fixture(scope="module")
def llm(folder):
    llm = LLM(str(folder), dtype="bfloat16", device="cuda", gpu_memory_utilization=0.3, max_model_len=1024)
    yield llm
    llm.engine.shutdown()  # later modules' engines need the memory back


@pytest.mark.parametrize("batched", [False, True], ids=["batch1", "batched"])
def test_bf16_prefill_logits_as_accurate_as_hf_bf16(llm, folder, batched):
    engine = llm.engine
    rng = random.Random(0)
    prompts = [[rng.randrange(990) for _ in range(n)] for n in (97, 64, 150, 33)][: 4 if batched else 1]
    chunks, requests = [], []
    for i, prompt in enumerate(prompts):
        request = Request(f"r{i}", prompt, SamplingParams())
        assert engine.buffers.allocate_slots(request, len(prompt))
        requests.append(request)
        chunks.append(SequenceChunk(f"r{i}", prompt, 0, engine.buffers.block_table(f"r{i}"), all_logits=True))
    out = engine.executor.execute(ModelBatch(chunks))
    for request in requests:
        engine.buffers.free(request)
    report = Bf16AccuracyReport(folder)
    for i, prompt in enumerate(prompts):
        report.add(prompt, out.all_logits[f"r{i}"])
    report.assert_as_accurate_as_hf(f"prefill {'batched' if batched else 'batch 1'}")


def test_bf16_decode_logits_as_accurate_as_hf_bf16(llm, folder):
    """Batched greedy decode through the paged cache; every step's logits are kept for the comparison."""
    rng = random.Random(1)
    prompts = [[rng.randrange(990) for _ in range(n)] for n in (40, 7, 120, 65)]
    report = Bf16AccuracyReport(folder)
    report.add_greedy_decode(llm.engine, prompts)
    report.assert_as_accurate_as_hf("decode batched")


def test_graph_decode_equals_eager_decode(folder):
    """CUDA-graph decode gives the same tokens as eager decode, over batch sizes that hit several buckets
    (with padding rows) and requests that join and leave; greedy, seeded random, penalized and logprob
    rows share batches (the graph's own greedy tokens, and the sampler's draws beside them)."""
    common = dict(DECODE_LLM, max_num_seqs=16)
    graph_llm = LLM(str(folder), **common)
    eager_llm = LLM(str(folder), enforce_eager=True, **common)
    assert graph_llm.engine.executor.capabilities.cuda_graphs
    assert not eager_llm.engine.executor.capabilities.cuda_graphs
    rng = random.Random(2)
    prompts = [[rng.randrange(990) for _ in range(rng.randrange(3, 90))] for _ in range(11)]
    kinds = [
        dict(temperature=0),
        dict(temperature=0.8, top_k=50, seed=7),
        dict(temperature=0, repetition_penalty=1.2),
        dict(temperature=0, logprobs=2),
    ]
    params = [
        SamplingParams(max_tokens=rng.randrange(5, 60), ignore_eos=True, **kinds[i % len(kinds)])
        for i in range(len(prompts))
    ]
    graph = graph_llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    eager = eager_llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in graph] == [o.outputs[0].token_ids for o in eager]
    graph_llm.engine.buffers.check_invariants()


def test_pdl_changes_nothing(folder, monkeypatch):
    """Programmatic dependent launch only moves when kernels start: graph decode with it and without it
    (``PEGAINFER_PDL=0``) gives bit-identical log-probabilities, so no kernel reads its input early."""
    common = dict(DECODE_LLM, max_num_seqs=8)
    rng = random.Random(5)
    prompts = [[rng.randrange(990) for _ in range(rng.randrange(3, 90))] for _ in range(6)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)

    def run():
        llm = LLM(str(folder), **common)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]

    with_pdl = run()
    monkeypatch.setenv("PEGAINFER_PDL", "0")
    assert run() == with_pdl
