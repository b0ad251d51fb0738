"""DeepSeek-V3 and V3.2 on the decode-graph path: their decode-only forward is the one CUDA graphs capture
(bucket-padded rows, static bound on the context, the MLA decode and fused MoE kernels on CUDA). V3
embeds on the device; V3.2 takes its embeddings from the runner, which makes them inside the graph, and
its indexer scores and selects over the static bound (every position past a row's length masked).

On the CPU ``capture_cuda_graphs(eager=True)`` runs that same padded forward without graphs: its greedy
tokens must equal the plain path's and transformers'. On a GPU, graph decode must give the tokens of
``enforce_eager`` decode (the same padded forward, no graphs); so must V3's short prefill steps, run as
decode rows in prefill graphs, and MTP drafting on both graph paths must keep the greedy tokens.
"""

from __future__ import annotations

import random

import pytest
import torch

from pegainfer import LLM, SamplingParams
from pegainfer.testing.conformance import hf_greedy


def _tokens(llm: LLM, prompts, params) -> list[list[int]]:
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("architecture", ["deepseek_v3", "deepseek_v32"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_padded_decode_path_equals_plain_path_and_transformers(
    tiny_checkpoint_factory, architecture, async_scheduling
):
    """Five requests of different lengths and budgets: the batch shrinks through the 8, 4, 2 and 1 buckets,
    so padding rows (copies of row 0, same slot) run beside real ones every step. V3.2's indexer keeps 4
    keys a query, so its selection drops keys from the fifth position on."""
    folder = tiny_checkpoint_factory(architecture)
    options = dict(
        dtype="float32", device="cpu", cpu_kv_cache_bytes=8 << 20, max_num_seqs=8,
        async_scheduling=async_scheduling,
    )  # fmt: skip
    rng = random.Random(4)
    prompts = [[rng.randrange(1, 200) for _ in range(rng.randrange(3, 30))] for _ in range(5)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 5, 9, 3, 7)]
    plain = LLM(str(folder), **options)
    graph_path = LLM(str(folder), **options)
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
    assert expected[:1] == hf_greedy(folder, prompts[:1], 12)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("architecture", ["deepseek_v3", "deepseek_v32"])
def test_graph_decode_equals_eager_decode(tiny_checkpoint_factory, architecture):
    """bf16 on the GPU: CUDA-graph decode (MLA decode and fused MoE inside the graphs; V3.2's indexer
    kernel, top-k and embedding too) gives the tokens of enforce_eager decode, over batches that cross
    buckets while requests join and leave."""
    folder = tiny_checkpoint_factory(architecture, seed=3, dtype="bfloat16")
    common = dict(
        dtype="bfloat16", device="cuda", gpu_memory_utilization=0.3, max_model_len=512, max_num_seqs=16
    )
    rng = random.Random(2)
    prompts = [[rng.randrange(1, 200) for _ in range(rng.randrange(3, 90))] for _ in range(11)]
    params = [
        SamplingParams(temperature=0, max_tokens=rng.randrange(5, 60), ignore_eos=True) for _ in prompts
    ]
    graph_llm = LLM(str(folder), **common)
    assert graph_llm.engine.executor.capabilities.cuda_graphs
    graph = _tokens(graph_llm, prompts, params)
    graph_llm.engine.buffers.check_invariants()
    del graph_llm
    torch.cuda.empty_cache()
    eager_llm = LLM(str(folder), enforce_eager=True, **common)
    assert not eager_llm.engine.executor.capabilities.cuda_graphs
    assert _tokens(eager_llm, prompts, params) == graph


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("architecture", ["deepseek_v3", "deepseek_v32"])
def test_prefill_graphs_equal_eager(tiny_checkpoint_factory, architecture):
    """bf16 on the GPU: prefix hits whose short tails run as decode rows in prefill CUDA graphs give the
    tokens of enforce_eager (the same decode-row forwards without graphs)."""
    from pegainfer.testing.conformance import assert_prefill_graphs_match_eager

    assert_prefill_graphs_match_eager(tiny_checkpoint_factory(architecture, seed=3, dtype="bfloat16"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("architecture", ["deepseek_v3", "deepseek_v32"])
def test_mtp_on_the_graph_paths_keeps_the_greedy_tokens(tiny_checkpoint_factory, architecture):
    """float32 on the GPU: with MTP drafting, verification chunks replay the prefill graphs and the MTP
    passes the draft graphs, and the greedy tokens are those of plain graph decode."""
    mtp = {"num_nextn_predict_layers": 1} if architecture == "deepseek_v32" else {}
    folder = tiny_checkpoint_factory(architecture, seed=3, dtype="float32", **mtp)
    common = dict(
        dtype="float32", device="cuda", gpu_memory_utilization=0.3, max_model_len=512, max_num_seqs=8
    )
    rng = random.Random(5)
    prompts = [[rng.randrange(1, 200) for _ in range(rng.randrange(3, 90))] for _ in range(6)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = LLM(str(folder), **common)
    expected = _tokens(plain, prompts, params)
    plain.engine.shutdown()
    del plain
    torch.cuda.empty_cache()
    llm = LLM(str(folder), speculative_num_tokens=2, **common)
    runner = llm.engine.executor.runner
    assert llm.engine.executor.capabilities.cuda_graphs and runner.draft_graphs is not None
    replays = {"prefill": 0, "draft": 0}
    for name, graphs in (("prefill", runner.prefill_graphs), ("draft", runner.draft_graphs)):
        run = graphs.run

        def counting(*args, _run=run, _name=name):
            replays[_name] += 1
            return _run(*args)

        graphs.run = counting
    assert _tokens(llm, prompts, params) == expected
    assert replays["prefill"] > 20 and replays["draft"] > 20, replays
    llm.engine.buffers.check_invariants()
    llm.engine.shutdown()
