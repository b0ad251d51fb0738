"""The Qwen3.5 reference path on a CUDA GPU in bf16 against HF transformers (``nox -s gpu``, not CI).

Dense and MoE; prefill (one prompt, a batch) and batched decode through the paged cache and state slots;
CUDA-graph decode against eager decode; MTP drafting's roll-backs through the prefill graphs.
As in the Qwen3 GPU test (docs/gpu-checks.md): random weights make a chaotic network, so two correct bf16
implementations disagree by more than on a trained model (here HF bf16 is itself ~0.2 nats from HF fp32
for the dense model and ~0.5 for the MoE one, whose routing flips under rounding). The gate is therefore
against the truth, HF in float32 on the same bf16 weights: over every teacher-forced position, the mean
|delta log-prob| of HF's top-8 tokens must be no worse for our bf16 path than for HF's own bf16 path
(within 25% + 0.01 nats). The direct bf16-vs-bf16 gap (mean and p99) is printed beside it.

The last checks measure the device memory one prefill forward allocates against the transient reserve the
memory plan was given for that many tokens, and what capturing the graphs keeps against their reserves.
"""

from __future__ import annotations

import random

import pytest
import torch

from pegainfer import LLM
from pegainfer.engine.request import Request
from pegainfer.executor.executor import ModelBatch, SequenceChunk
from pegainfer.memory.rank_plan import step_transients
from pegainfer.sampling.sampling_params import SamplingParams
from pegainfer.testing.conformance import Bf16AccuracyReport
from pegainfer.testing.speculative import force_drafts
from pegainfer_qwen35 import gated_deltanet

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SHAPE = {
    "hidden_size": 512,
    "num_hidden_layers": 8,  # full attention at layers 1 and 5, Gated DeltaNet elsewhere
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 8,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
}
VARIANTS = {
    "qwen3_5": {**SHAPE, "intermediate_size": 1536},
    "qwen3_5_moe": {
        **SHAPE,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 256,
        "shared_expert_intermediate_size": 512,
    },
}


@pytest.fixture(scope="module", params=sorted(VARIANTS), ids=["dense", "moe"])
def folder(request, tiny_checkpoint_factory):
    return tiny_checkpoint_factory(request.param, seed=3, dtype="bfloat16", **VARIANTS[request.param])


@pytest.fixture(scope="module")
def llm(folder):
    llm = LLM(str(folder), dtype="bfloat16", device="cuda", gpu_memory_utilization=0.3, max_model_len=1024)
    yield llm
    llm.engine.shutdown()  # the other variant's engines need the memory back


def _prefill(llm: LLM, prompts: list[list[int]]) -> dict[str, torch.Tensor]:
    engine = llm.engine
    chunks, requests = [], []
    for i, prompt in enumerate(prompts):
        rid = f"r{i}"
        request = Request(rid, prompt, SamplingParams())
        assert engine.buffers.allocate_slots(request, len(prompt))
        requests.append(request)
        chunks.append(
            SequenceChunk(
                rid,
                prompt,
                0,
                engine.buffers.block_table(rid),
                state_slot=engine.buffers.state_slot(rid),
                all_logits=True,
            )
        )
    try:
        return engine.executor.execute(ModelBatch(chunks)).all_logits
    finally:
        for request in requests:
            engine.buffers.free(request)


@pytest.mark.parametrize("batched", [False, True], ids=["batch1", "batched"])
def test_bf16_prefill_logits_match_hf(llm, folder, batched):
    rng = random.Random(0)
    prompts = [[rng.randrange(990) for _ in range(n)] for n in (97, 64, 150, 33)][: 4 if batched else 1]
    logits = _prefill(llm, prompts)
    report = Bf16AccuracyReport(folder)
    for i, prompt in enumerate(prompts):
        report.add(prompt, logits[f"r{i}"])
    report.assert_as_accurate_as_hf(f"{folder.name} prefill {'batched' if batched else 'batch 1'}")


def test_bf16_decode_logits_match_hf(llm, folder):
    """Batched greedy decode (all rows of a step in one recurrent update); every step's logits are kept."""
    rng = random.Random(1)
    prompts = [[rng.randrange(990) for _ in range(n)] for n in (40, 7, 120, 65)]
    report = Bf16AccuracyReport(folder)
    report.add_greedy_decode(llm.engine, prompts)
    report.assert_as_accurate_as_hf(f"{folder.name} decode batched")


def test_graph_decode_equals_eager_decode(folder):
    """CUDA-graph decode (the fused GDN and gated-attention decode kernels captured) gives the same greedy
    tokens as eager decode, over batch sizes that hit several buckets as requests of different lengths
    join and leave."""
    common = dict(dtype="bfloat16", device="cuda", gpu_memory_utilization=0.15, max_model_len=512)
    graph_llm = LLM(str(folder), max_num_seqs=8, **common)
    eager_llm = LLM(str(folder), max_num_seqs=8, enforce_eager=True, **common)
    assert graph_llm.engine.executor.capabilities.cuda_graphs
    rng = random.Random(4)
    prompts = [[rng.randrange(990) for _ in range(rng.randrange(3, 120))] for _ in range(7)]
    params = [SamplingParams(max_tokens=rng.randrange(5, 40), ignore_eos=True) for _ in prompts]
    graph = graph_llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    eager = eager_llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    graph_llm.engine.shutdown()
    eager_llm.engine.shutdown()
    assert [o.outputs[0].token_ids for o in graph] == [o.outputs[0].token_ids for o in eager]


@pytest.mark.parametrize(("k", "right"), [(1, 0), (3, 1), (3, 2), (2, None)])
def test_drafting_keeps_the_greedy_tokens(folder, k, right):
    """Float32 on the GPU paths (decode graphs without drafting; with it, verification chunks through the
    prefill graphs, the GDN kernels saving the roll-back states): drafts forced to accept ``right`` of
    ``k`` (None: all) give the greedy tokens of decoding without drafts."""
    common = dict(dtype="float32", device="cuda", gpu_memory_utilization=0.15, max_model_len=512)
    rng = random.Random(5)
    prompts = [[rng.randrange(990) for _ in range(n)] for n in (7, 40, 90)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    outputs = []
    for drafts in (0, k):
        llm = LLM(str(folder), speculative_num_tokens=drafts, **common)
        if drafts:
            force_drafts(llm, {tuple(p): p + o for p, o in zip(prompts, outputs[0], strict=True)}, right)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        outputs.append([o.outputs[0].token_ids for o in outs])
        llm.engine.shutdown()
    assert outputs[1] == outputs[0]


@pytest.mark.parametrize("lengths", [(256,), (300, 200, 24)], ids=["one", "three"])
def test_prefill_forward_stays_within_its_transient_reserve(llm, lengths):
    """Device memory a prefill forward allocates beyond what existed before it (pass buffers and the
    path's temporaries) fits in the ``transient_specs`` reserve for that many tokens and segments. With
    fla installed the model takes the kernel path, whose reserve is the tight one (``kernel_scratch``)."""
    model = llm.engine.executor.runner.model
    if gated_deltanet.fla_chunk_rule() is not None:
        assert model.kernel_path
    forward = model.forward
    measured: list[tuple[int, int]] = []

    def measuring_forward(batch, caches, states):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        hidden = forward(batch, caches, states)
        torch.cuda.synchronize()
        measured.append((batch.token_ids.shape[0], torch.cuda.max_memory_allocated() - before))
        return hidden

    model.forward = measuring_forward
    rng = random.Random(2)
    try:
        _prefill(llm, [rng.choices(range(990), k=n) for n in lengths])
    finally:
        del model.forward
    (tokens, used), *_ = measured
    reserve = sum(spec.bytes_for(tokens, len(lengths)) for spec in model.transient_specs())
    print(
        f"prefill of {lengths} tokens (kernel path {model.kernel_path}): forward allocated "
        f"{used / 2**20:.1f} MiB, reserve {reserve / 2**20:.1f} MiB"
    )
    assert used <= reserve


def test_graph_capture_stays_within_its_reserves(folder):
    """Device memory that capturing the decode, prefill and draft graphs keeps (the graph pool's segments,
    the graphs' static outputs, the drafter's inputs) fits in the reserves the memory plan makes for them
    (``step_transients``: cuda_graphs, prefill_graphs, draft_graphs)."""
    llm = LLM(
        str(folder), dtype="bfloat16", device="cuda", gpu_memory_utilization=0.3, max_model_len=1024,
        speculative_num_tokens=2, enforce_eager=True,
    )  # fmt: skip
    runner, config = llm.engine.executor.runner, llm.engine.config
    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the capture's warm-up forwards use the transient reserve, not these
        before = torch.cuda.memory_reserved()
        runner.capture_cuda_graphs()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        used = torch.cuda.memory_reserved() - before
        sched = config.scheduler
        reserves = {
            spec.role: spec.bytes_for(sched.max_num_batched_tokens, sched.max_num_seqs)
            for spec in step_transients(runner.loaded, config, graphs=True)
            if spec.role in ("cuda_graphs", "prefill_graphs", "draft_graphs")
        }
    finally:
        llm.engine.shutdown()
    print(
        f"graph capture kept {used / 2**20:.1f} MiB; reserves (MiB):",
        {k: round(v / 2**20, 1) for k, v in reserves.items()},
    )
    assert set(reserves) == {"cuda_graphs", "prefill_graphs", "draft_graphs"}
    assert used <= sum(reserves.values())
