"""Async scheduling (a step launched before the last one's tokens are read back) changes no output.

On the CPU nothing runs concurrently, but the bookkeeping is the same as on a GPU: pending tokens,
decode rows fed from the previous step's device tensor, finished requests planned once more and
dropped, the read-back before any plan that could preempt. Each test runs the same workload with
``async_scheduling`` on and off and compares every output, and checks that steps really were planned
ahead (so the test cannot pass with the feature silently off).
"""

from __future__ import annotations

import random

import pytest

from pegainfer import LLM, SamplingParams, StructuredOutputsParams
from pegainfer.errors import ConfigError
from pegainfer.sampling.sampling_params import RequestOutputKind


def _llm(tiny_qwen3, async_scheduling: bool, graph_path: bool = False, **kwargs) -> LLM:
    """``graph_path``: decode steps take the GPU's decode-graph path (eager graphs on the CPU)."""
    options = dict(dtype="float32", device="cpu", cpu_kv_cache_bytes=8 << 20, max_model_len=256)
    options.update(kwargs)
    llm = LLM(str(tiny_qwen3), async_scheduling=async_scheduling, **options)
    if graph_path:
        llm.engine.executor.capture_cuda_graphs(eager=True)
    return llm


def _count_carried_steps(llm: LLM) -> list[int]:
    """Wrap the executor so the test sees how many steps took tokens from the device."""
    executor = llm.engine.executor
    seen = [0]
    execute = executor.execute

    def counting(batch):
        if batch.carried_tokens is not None and any(c.carry_from >= 0 for c in batch.chunks):
            seen[0] += 1
        return execute(batch)

    executor.execute = counting
    return seen


def _check_reused_batches(llm: LLM) -> list[int]:
    """Wrap the engine's batch building so every batch it hands the executor is compared with one built
    afresh for the same plan (chunk for chunk, the carried tokens the same tensor); counts the steps that
    moved last step's batch on instead of building one."""
    batches = llm.engine.batches
    build = batches.build
    reused = [0]
    last: list[object] = [None]

    def checked(plan, pending, step):
        batch = build(plan, pending, step)
        fresh = batches._new_batch(plan, pending)
        assert batch.chunks == fresh.chunks
        assert batch.carried_tokens is fresh.carried_tokens
        reused[0] += batch is last[0]
        last[0] = batch
        return batch

    batches.build = checked
    return reused


def _count_moved_on_graph_steps(llm: LLM) -> list[int]:
    """Count the decode-graph steps the executor ran from the row inputs it kept for a moved-on batch."""
    executor, runner = llm.engine.executor, llm.engine.executor.runner
    count = [0]
    execute = executor.execute

    def counting(batch):
        kept = runner._graph_rows
        out = execute(batch)
        count[0] += batch.moved_on and kept is not None and runner._graph_rows is kept
        return out

    executor.execute = counting
    return count


def _prompts(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 1000) for _ in range(rng.randrange(3, 40))] for _ in range(count)]


def _summary(outputs):
    return [
        [
            (c.token_ids, c.text, c.finish_reason, c.stop_reason, c.cumulative_logprob, c.logprobs)
            for c in out.outputs
        ]
        for out in outputs
    ]


# Structured outputs: each row's mask comes from the tokens appended before its step is sampled.
_SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


def _mixed_params(llm: LLM, count: int) -> list[SamplingParams]:
    """Greedy with lengths, EOS, stop ids and strings, n=2, logprobs, penalties, seeded sampling, structured
    outputs."""
    ref = llm.generate(
        prompt_token_ids=_prompts(1, 1), sampling_params=SamplingParams(temperature=0, max_tokens=12),
        use_tqdm=False,
    )[0].outputs[0]  # fmt: skip
    kinds = [
        SamplingParams(temperature=0, max_tokens=17, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=9),
        SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[ref.token_ids[4]]),
        SamplingParams(temperature=0, max_tokens=20, stop=[ref.text[3:6]], min_tokens=2),
        SamplingParams(temperature=0, max_tokens=6, n=2, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=11, logprobs=3, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=13, repetition_penalty=1.3, frequency_penalty=0.4),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=1),
        SamplingParams(
            temperature=0, max_tokens=30, structured_outputs=StructuredOutputsParams(json=_SCHEMA)
        ),
        SamplingParams(
            temperature=0.9,
            seed=11,
            max_tokens=8,
            structured_outputs=StructuredOutputsParams(regex="[a-c]{2,5}"),
        ),
    ]
    return [kinds[i % len(kinds)] for i in range(count)]


def _generate(llm: LLM, prompts, params):
    return llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)


def test_mixed_batch_outputs_identical(tiny_qwen3):
    prompts = _prompts(2, 24)
    sync = _llm(tiny_qwen3, False, max_num_seqs=8)
    ahead = _llm(tiny_qwen3, True, max_num_seqs=8)
    params = _mixed_params(sync, len(prompts))
    carried = _count_carried_steps(ahead)
    reused = _check_reused_batches(ahead)
    assert _summary(_generate(ahead, prompts, params)) == _summary(_generate(sync, prompts, params))
    assert carried[0] > 10 and reused[0] > 0
    assert ahead.engine.buffers.usage() == 0.0 and not ahead.engine.has_unfinished_requests()
    ahead.engine.buffers.check_invariants()


def test_mixed_batch_on_the_graph_decode_path_identical(tiny_qwen3):
    """The GPU's decode path (persistent rows, bucket padding; eager graphs on the CPU): the carried
    tokens are gathered and the greedy argmax taken inside the graph's forward, the sampler takes those
    greedy tokens and writes its other rows' draws into them, penalized rows are copied back in; the
    outputs equal the synchronous run's on the same path."""
    prompts = _prompts(5, 24)
    sync = _llm(tiny_qwen3, False, graph_path=True, max_num_seqs=8)
    ahead = _llm(tiny_qwen3, True, graph_path=True, max_num_seqs=8)
    params = _mixed_params(sync, len(prompts))
    carried = _count_carried_steps(ahead)
    given = [0]
    sample = ahead.engine.sampler.sample

    def counting(logits, requests, greedy=None):
        given[0] += greedy is not None
        return sample(logits, requests, greedy)

    ahead.engine.sampler.sample = counting
    reused = _check_reused_batches(ahead)
    kept = _count_moved_on_graph_steps(ahead)
    assert _summary(_generate(ahead, prompts, params)) == _summary(_generate(sync, prompts, params))
    assert carried[0] > 10 and given[0] > 10 and reused[0] > 0 and kept[0] > 0
    assert ahead.engine.buffers.usage() == 0.0 and not ahead.engine.has_unfinished_requests()


@pytest.mark.parametrize("graph_path", [False, True], ids=["eager", "graph-path"])
def test_preemption_and_chunked_prefill_identical(tiny_qwen3, graph_path):
    """A page pool too small for the batch: plans that preempt read the tokens back first."""
    prompts = _prompts(3, 10)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    options = dict(
        num_gpu_blocks_override=18, block_size=4, max_num_batched_tokens=16, max_num_seqs=6, max_model_len=64
    )
    sync = _llm(tiny_qwen3, False, graph_path, **options)
    ahead = _llm(tiny_qwen3, True, graph_path, **options)
    carried = _count_carried_steps(ahead)
    preempted = _count_preemptions(ahead)
    reused = _check_reused_batches(ahead)
    kept = _count_moved_on_graph_steps(ahead)
    assert _summary(_generate(ahead, prompts, params)) == _summary(_generate(sync, prompts, params))
    assert carried[0] > 0 and preempted[0] > 0 and reused[0] > 0 and (kept[0] > 0) == graph_path
    ahead.engine.buffers.check_invariants()


def _count_preemptions(llm: LLM) -> list[int]:
    scheduler = llm.engine.scheduler
    count = [0]
    schedule = scheduler.schedule

    def counting():
        plan = schedule()
        count[0] += len(plan.preempted)
        return plan

    scheduler.schedule = counting
    return count


@pytest.mark.parametrize("graph_path", [False, True], ids=["eager", "graph-path"])
def test_streaming_arrivals_and_aborts(tiny_qwen3, graph_path):
    """Requests arrive and are aborted between steps (while a step is pending); DELTA outputs add up to
    the same text, the survivors are unaffected, and every page comes back."""
    results = {}
    for mode in (False, True):
        llm = _llm(tiny_qwen3, mode, graph_path, max_num_seqs=4)
        reused = _check_reused_batches(llm)
        engine = llm.engine
        prompts = _prompts(4, 8)
        params = SamplingParams(
            temperature=0, max_tokens=15, ignore_eos=True, output_kind=RequestOutputKind.DELTA
        )
        texts: dict[str, list] = {}
        step = 0
        while step < 200:
            if step < len(prompts):
                engine.add_request(f"r{step}", None, params, prompt_token_ids=prompts[step])
            if step == 6:
                engine.abort_request("r2")
            if step == 9:
                engine.abort_request("r5")
                engine.add_request("r2", None, params, prompt_token_ids=prompts[0])  # a reused id
            for out in engine.step():
                texts.setdefault(out.request_id, []).append((out.outputs[0].token_ids, out.outputs[0].text))
            step += 1
            if step > len(prompts) and not engine.has_unfinished_requests():
                break
        assert engine.buffers.usage() == 0.0
        engine.buffers.check_invariants()
        assert (reused[0] > 0) == mode
        results[mode] = {
            rid: ([t for ids, _ in chunks for t in ids], "".join(text for _, text in chunks))
            for rid, chunks in texts.items()
            if rid not in ("r2", "r5")
        }
    assert results[True] == results[False]
    assert len(results[True]) == 6


def test_async_needs_no_speculation(tiny_checkpoint_factory):
    path = tiny_checkpoint_factory("deepseek_v3")
    options = dict(dtype="float32", device="cpu", cpu_kv_cache_bytes=8 << 20, async_scheduling=True)
    with pytest.raises(ConfigError, match="async_scheduling"):
        LLM(str(path), speculative_num_tokens=1, **options)


def test_async_takes_a_model_handed_its_embeddings(tiny_checkpoint_factory):
    """The runner embeds the carried tokens on the device for a model that does not embed itself (V3.2)."""
    path = tiny_checkpoint_factory("deepseek_v32")
    llm = LLM(str(path), dtype="float32", device="cpu", cpu_kv_cache_bytes=8 << 20, async_scheduling=True)
    assert llm.engine.async_scheduling


def test_off_by_default_on_the_cpu(tiny_qwen3):
    assert not _llm(tiny_qwen3, None).engine.async_scheduling
