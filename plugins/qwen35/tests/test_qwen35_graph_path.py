"""Qwen3.5 on the decode-graph path: the model embeds on the device and its decode-only forward is the
one the CUDA graphs capture (bucket-padded rows, state slots read from the persistent decode buffers).

On the CPU ``capture_cuda_graphs(eager=True)`` runs that same padded forward without graphs: its greedy
tokens must equal the plain path's and transformers'. On a GPU, graph decode must give the tokens of
``enforce_eager`` decode (the same padded forward, no graphs), through the fused GDN decode kernels.
"""

from __future__ import annotations

import random

import pytest
import torch

from pegainfer import LLM, SamplingParams
from pegainfer.testing.conformance import hf_greedy


def _prompts(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(990) for _ in range(rng.randrange(3, 40))] for _ in range(count)]


def _tokens(llm: LLM, prompts, params) -> list[list[int]]:
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_model_embeds_on_the_device(tiny_qwen35):
    llm = LLM(str(tiny_qwen35), dtype="float32", device="cpu", cpu_kv_cache_bytes=8 << 20)
    assert llm.engine.executor.runner.model.embeds_on_device
    assert llm.engine.executor.capabilities.device_embedding


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_padded_decode_path_equals_plain_path_and_transformers(tiny_qwen35, async_scheduling):
    """Five requests of different lengths and budgets: the batch shrinks through the 8, 4, 2 and 1
    buckets, so padding rows (copies of row 0, same state slot) run beside real ones every step. As in
    the GPU kernels, a padding row reads zeros for state and so computes other values than row 0: had it
    written its KV into row 0's page (padding once did), row 0's tokens would drift from the plain path."""
    options = dict(
        dtype="float32", device="cpu", cpu_kv_cache_bytes=8 << 20, max_num_seqs=8,
        async_scheduling=async_scheduling,
    )  # fmt: skip
    prompts = _prompts(3, 5)
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 5, 9, 3, 7)
    ]  # fmt: skip
    plain = LLM(str(tiny_qwen35), **options)
    graph_path = LLM(str(tiny_qwen35), **options)
    graph_path.engine.executor.capture_cuda_graphs(eager=True)
    runs = [0]
    graphs = graph_path.engine.executor.runner.graphs
    run = graphs.run

    def counting(batch):
        runs[0] += 1
        return run(batch)

    graphs.run = counting
    expected = _tokens(plain, prompts, params)
    assert _tokens(graph_path, prompts, params) == expected
    assert runs[0] > 5, "decode steps did not take the padded graph path"
    graph_path.engine.buffers.check_invariants()
    # transformers, one prompt at a time, for the longest budget
    assert [t[:12] for t in expected[:1]] == hf_greedy(tiny_qwen35, prompts[:1], 12)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "architecture_name",
    [
        "qwen3_5",
        # The MoE model's mixed steps (prefill rows beside decode rows) run the grouped expert schedule:
        # this once drifted after 13 tokens while it summed with index_add_'s float atomics.
        "qwen3_5_moe",
    ],
    ids=["dense", "moe"],
)
def test_graph_decode_equals_eager_decode(tiny_checkpoint_factory, architecture_name):
    """bf16 on the GPU: CUDA-graph decode (the GDN kernels inside the graphs) gives the tokens of
    enforce_eager decode, over batches that cross buckets (padding rows) while requests join and leave."""
    from test_qwen35_gpu import VARIANTS

    folder = tiny_checkpoint_factory(
        architecture_name, seed=3, dtype="bfloat16", **VARIANTS[architecture_name]
    )
    common = dict(
        dtype="bfloat16", device="cuda", gpu_memory_utilization=0.3, max_model_len=512, max_num_seqs=16
    )
    graph_llm = LLM(str(folder), **common)
    assert graph_llm.engine.executor.capabilities.cuda_graphs
    rng = random.Random(2)
    prompts = [[rng.randrange(990) for _ in range(rng.randrange(3, 90))] for _ in range(11)]
    params = [
        SamplingParams(temperature=0, max_tokens=rng.randrange(5, 60), ignore_eos=True) for _ in prompts
    ]
    graph = _tokens(graph_llm, prompts, params)
    graph_llm.engine.buffers.check_invariants()
    del graph_llm
    torch.cuda.empty_cache()
    eager_llm = LLM(str(folder), enforce_eager=True, **common)
    assert not eager_llm.engine.executor.capabilities.cuda_graphs
    assert _tokens(eager_llm, prompts, params) == graph


@pytest.mark.gpu
@pytest.mark.parametrize("architecture_name", ["qwen3_5", "qwen3_5_moe"], ids=["dense", "moe"])
def test_prefill_graphs_equal_eager(tiny_checkpoint_factory, architecture_name):
    """bf16 on the GPU: prefix hits whose short tails (and the state checkpoints inside them) replay from
    prefill CUDA graphs give the tokens of enforce_eager."""
    from test_qwen35_gpu import VARIANTS

    from pegainfer.testing.conformance import assert_prefill_graphs_match_eager

    folder = tiny_checkpoint_factory(
        architecture_name, seed=3, dtype="bfloat16", **VARIANTS[architecture_name]
    )
    assert_prefill_graphs_match_eager(folder)
