"""MTP speculative decoding end to end on the tiny DeepSeek-V3 (float32, CPU).

The invariant: greedy output with ``speculative.num_tokens=k`` is token for token the output without it —
single, batched with mixed lengths, with chunked prefill, with preemption, with a stop in the middle of
the accepted drafts. The tiny checkpoint's MTP layer is random, so its drafts are nearly always wrong
(every step rolls back). Three ways make drafts right: an "aligned" checkpoint (the main model made
nearly a bigram model and the MTP layer its copy, so the real MTP path drafts the target most of the
time), and a drafter patched to return the target's own continuation (all right) or a wrong token
(all wrong), which prove accepted drafts are used and steps drop accordingly. The drafts the engine
proposes equal those of the MTP module run from scratch over the whole sequence, so its cache is whole.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch

from pegainfer import LLM
from pegainfer.config.compose import build_engine_config, compose
from pegainfer.errors import ConfigError
from pegainfer.layers.attention import AttentionMetadata, PrefillSegment
from pegainfer.model.model_api import ForwardBatch
from pegainfer.testing.conformance import SamplingParams, random_prompts
from pegainfer.testing.speculative import (
    assert_draft_passes_on_graph_path,
    assert_verification_on_prefill_graphs,
    echoing_prompts,
    force_drafts,
    generate,
    generate_counting,
    token_ids,
)


def _llm(folder: Path, k: int = 0, **kw: object) -> LLM:
    kw.setdefault("cpu_kv_cache_bytes", 8 << 20)
    return LLM(str(folder), dtype="float32", device="cpu", speculative_num_tokens=k, **kw)


@pytest.fixture(scope="module")
def base(tiny_deepseek: Path) -> LLM:
    return _llm(tiny_deepseek)


# ------------------------------------------------------------------------------------ configuration


def test_speculative_num_tokens_composes_from_the_cli() -> None:
    assert build_engine_config(compose("generate", ["speculative.num_tokens=2"])).speculative.num_tokens == 2
    with pytest.raises(ConfigError, match="speculative.num_tokens"):
        build_engine_config(compose("generate", ["speculative.num_tokens=-1"]))


def test_model_without_mtp_is_a_config_error(tiny_checkpoint_factory) -> None:
    no_mtp = tiny_checkpoint_factory("deepseek_v3", num_nextn_predict_layers=0)
    with pytest.raises(ConfigError, match=r"speculative\.num_tokens=2 needs a model with draft \(MTP\)"):
        _llm(no_mtp, 2)


def test_off_allocates_nothing_for_drafting(base: LLM) -> None:
    engine = base.engine
    assert engine.speculative is None and engine.executor.capabilities.max_speculative_tokens == 0
    assert sorted(engine.executor.runner.buffers.caches) == [0, 1, 2]


def test_on_adds_the_mtp_cache_to_the_pages(tiny_deepseek: Path, base: LLM) -> None:
    engine = _llm(tiny_deepseek, 2).engine
    assert engine.executor.capabilities.max_speculative_tokens == 2
    assert sorted(engine.executor.runner.buffers.caches) == [0, 1, 2, 3]
    assert engine.executor.plan.page_bytes == base.engine.executor.plan.page_bytes * 4 // 3


# --------------------------------------------------------------------------------- output invariance


@pytest.fixture(scope="module", params=[1, 2])
def spec(request: pytest.FixtureRequest, tiny_deepseek: Path) -> LLM:
    return _llm(tiny_deepseek, request.param)


def test_single_prompt_output_unchanged(base: LLM, spec: LLM) -> None:
    prompts = random_prompts(0, [11])
    outs, stats = generate_counting(spec, prompts)
    assert token_ids(outs) == token_ids(generate(base, prompts))
    k = spec.engine.config.speculative.num_tokens
    assert stats["spec_draft_tokens"] == outs[0].metrics.spec_draft_tokens > 0
    assert outs[0].metrics.spec_acceptance_rate is not None
    if stats["spec_accepted_tokens"] == 0:  # random MTP weights: every draft is rejected
        # After output token n the request drafts min(k, 23 - n) tokens (never past max_tokens).
        assert stats["spec_draft_tokens"] == sum(min(k, 23 - n) for n in range(1, 24))


def test_batch_of_mixed_lengths_output_unchanged(base: LLM, spec: LLM) -> None:
    prompts = random_prompts(1, [1, 5, 17, 33, 2, 64])
    assert token_ids(generate(spec, prompts)) == token_ids(generate(base, prompts))


def test_verification_on_the_prefill_graph_path(tiny_deepseek: Path, base: LLM) -> None:
    """Verification chunks on the bucket-padded prefill-graph path, where MLA runs every token as an
    absorbed-form decode row over its own context (``decode_form``)."""
    assert_verification_on_prefill_graphs(partial(_llm, tiny_deepseek), base, random_prompts(7, [9, 21, 4]))


def test_padding_rows_route_as_row_zero_on_the_prefill_graph_path(tiny_deepseek: Path, base: LLM) -> None:
    """Three requests verifying one draft each are six tokens in the 8-token prefill graph: its two
    padding rows take row 0's experts in every MoE layer, the MTP module's included (routing.py), and the
    output stays the plain path's."""
    from pegainfer_deepseek.moe import GroupLimitedRouter

    llm = _llm(tiny_deepseek, 1)
    llm.engine.executor.capture_cuda_graphs(eager=True)
    padded: list[int] = []

    def check(module, inputs, output) -> None:
        real = inputs[1] if len(inputs) > 1 else None
        if real is not None and int(real) < output[1].shape[0]:
            ids, n = output[1], int(real)
            assert torch.equal(ids[n:], ids[:1].expand(ids.shape[0] - n, -1))
            padded.append(ids.shape[0] - n)

    model = llm.engine.executor.runner.model
    hooks = [m.register_forward_hook(check) for m in model.modules() if isinstance(m, GroupLimitedRouter)]
    prompts = random_prompts(8, [6, 11, 19])
    try:
        assert token_ids(generate(llm, prompts)) == token_ids(generate(base, prompts))
    finally:
        for hook in hooks:
            hook.remove()
    assert 2 in padded, f"padding rows seen: {sorted(set(padded))}"


def test_draft_passes_on_the_graph_path(tiny_deepseek: Path) -> None:
    """The MTP passes on the draft graphs (decode rows too) propose the plain path's drafts."""
    assert_draft_passes_on_graph_path(partial(_llm, tiny_deepseek), random_prompts(5, [5, 17, 3, 30]))


@pytest.mark.parametrize("k", [1, 3])
def test_chunked_prefill_output_unchanged(tiny_deepseek: Path, base: LLM, k: int) -> None:
    # Chunks of at most 5 tokens, 8 tokens a step: drafts are cut or dropped when the budget is short.
    llm = _llm(tiny_deepseek, k, long_prefill_token_threshold=5, max_num_batched_tokens=8)
    prompts = random_prompts(2, [45, 30, 9])
    assert token_ids(generate(llm, prompts)) == token_ids(generate(base, prompts))


@pytest.mark.parametrize("k", [1, 3])
def test_preempted_output_unchanged(tiny_deepseek: Path, base: LLM, k: int) -> None:
    llm = _llm(tiny_deepseek, k, block_size=4, num_gpu_blocks_override=24, max_model_len=64)
    prompts = random_prompts(3, [16, 12, 15, 14])
    outs = generate(llm, prompts)
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert token_ids(outs) == token_ids(generate(base, prompts))
    llm.engine.buffers.check_invariants()
    assert llm.engine.buffers.pool.num_free == 24


def test_logprobs_and_sampled_requests_unchanged(base: LLM, spec: LLM) -> None:
    """Greedy rows with logprobs draft and report the same logprobs; seeded sampled rows do not draft and
    draw the same tokens."""
    prompts = random_prompts(4, [7, 13])
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    sampled = SamplingParams(temperature=0.9, top_k=50, seed=7, max_tokens=12, ignore_eos=True)
    ours = spec.generate(prompt_token_ids=prompts, sampling_params=[greedy, sampled], use_tqdm=False)
    ref = base.generate(prompt_token_ids=prompts, sampling_params=[greedy, sampled], use_tqdm=False)
    assert token_ids(ours) == token_ids(ref)
    assert ours[0].metrics.spec_draft_tokens > 0 and ours[1].metrics.spec_draft_tokens == 0
    for a, b in zip(ours[0].outputs[0].logprobs, ref[0].outputs[0].logprobs, strict=True):
        assert a.keys() == b.keys()
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 and a[t].rank == b[t].rank for t in a)


# ---------------------------------------------------------------------- drafts that are (partly) right


@pytest.mark.parametrize("k", [1, 2, 3])
def test_aligned_mtp_drafts_are_accepted(aligned_deepseek: Path, k: int) -> None:
    prompts = random_prompts(5, [5, 17, 3, 30])
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    ref, ref_stats = generate_counting(_llm(aligned_deepseek), prompts, params)
    outs, stats = generate_counting(_llm(aligned_deepseek, k), prompts, params)
    assert token_ids(outs) == token_ids(ref)
    rate = stats["spec_accepted_tokens"] / stats["spec_draft_tokens"]
    print(
        f"aligned MTP, k={k}: acceptance {rate:.2f}, steps {stats['steps']} (without drafts {ref_stats['steps']})"
    )
    assert rate > 0.25
    assert stats["steps"] < ref_stats["steps"] - 3
    accepted = sum(o.metrics.spec_accepted_tokens for o in outs)
    assert accepted == stats["spec_accepted_tokens"]


@pytest.mark.parametrize(
    ("right", "k", "rate", "steps"),
    [
        (None, 1, 1.0, 1 + 23 // 2 + 1),  # all right: 1 prefill step + ceil(23 / 2)
        (None, 3, 1.0, 1 + 23 // 4 + 1),  # 1 + ceil(23 / 4)
        (0, 3, 0.0, 24),  # all wrong
        (1, 3, None, 1 + 23 // 2 + 1),  # one accepted + the bonus each step
    ],
)
def test_forced_drafts_set_the_steps(tiny_deepseek: Path, base: LLM, right, k: int, rate, steps: int) -> None:
    prompts = random_prompts(6, [9])
    ref = generate(base, prompts)
    truth = {tuple(prompts[0]): prompts[0] + ref[0].outputs[0].token_ids}
    llm = _llm(tiny_deepseek, k)
    force_drafts(llm, truth, right)
    outs, stats = generate_counting(llm, prompts)
    assert token_ids(outs) == token_ids(ref)
    assert stats["steps"] == steps
    measured = outs[0].metrics.spec_acceptance_rate
    print(
        f"forced drafts ({right} right), k={k}: acceptance {measured:.2f}, {stats['steps']} steps for 24 tokens"
    )
    if rate is not None:
        assert measured == rate
    else:
        assert stats["spec_accepted_tokens"] == stats["steps"] - 2  # one per verifying step


def test_stop_token_in_the_middle_of_accepted_drafts(tiny_deepseek: Path, base: LLM) -> None:
    prompts = random_prompts(7, [6])
    ref = token_ids(generate(base, prompts))[0]
    truth = {tuple(prompts[0]): prompts[0] + ref}
    # The first token that has not occurred before position 6 of the output stops the request there.
    cut = next(i for i in range(6, len(ref)) if ref[i] not in ref[:i])
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop_token_ids=[ref[cut]])
    llm = _llm(tiny_deepseek, 4)
    force_drafts(llm, truth, None)
    outs = generate(llm, prompts, params)
    assert token_ids(outs) == token_ids(generate(base, prompts, params)) == [ref[: cut + 1]]
    assert outs[0].outputs[0].finish_reason == "stop"
    llm.engine.buffers.check_invariants()
    assert llm.engine.buffers.pool.num_free == llm.engine.buffers.pool.num_blocks


# ------------------------------------------------------------------------------ the MTP cache is whole


def _batch(positions: list[int], block_size: int, decode: bool = False) -> ForwardBatch:
    """One prefill segment over pages 0, 1, 2, ... (or one decode row) at ``positions``."""
    pos = torch.tensor(positions)
    table = torch.arange(64)
    slots = table[pos // block_size] * block_size + pos % block_size
    if not decode:
        segment = PrefillSegment(0, len(positions), positions[-1] + 1, table)
        return ForwardBatch(pos, pos, AttentionMetadata(block_size, slots, [segment], len(positions)))
    meta = AttentionMetadata(block_size, slots, [], 0, 1, table[None], pos + 1, positions[-1] + 1)
    return ForwardBatch(pos, pos, meta)


@torch.no_grad()
def _reference_drafts(model, tokens: list[int], k: int) -> tuple[list[int], float]:
    """The drafts after ``tokens`` from scratch: the main model over all but the last token, the MTP module
    over every position, then chained; and the smallest top-1/top-2 logit gap met on the way."""
    bs, last = 4, len(tokens) - 1
    specs = [*model.buffer_specs(), *model.mtp_buffer_specs()]
    caches = {s.layer_index: torch.zeros(s.page_shape(64, bs)) for s in specs}
    batch = _batch(list(range(last)), bs)
    batch.hidden_states = model.embed(torch.tensor(tokens[:last]))
    hidden = model(batch, caches, {})
    logits, h = model.mtp_forward(hidden, torch.tensor(tokens[1:]), batch, caches, return_hidden=True)
    logits, h = logits[-1:], h[-1:]
    drafts, gap = [], float("inf")
    for j in range(k):
        top = logits[0].topk(2).values
        gap = min(gap, (top[0] - top[1]).item())
        drafts.append(int(logits[0].argmax()))
        if j + 1 < k:
            step = _batch([last + j], bs, decode=True)
            logits, h = model.mtp_forward(h, torch.tensor(drafts[-1:]), step, caches, return_hidden=True)
    return drafts, gap


@pytest.mark.parametrize("checkpoint", ["tiny_deepseek", "aligned_deepseek"])
def test_proposed_drafts_match_the_mtp_run_from_scratch(checkpoint: str, request, monkeypatch) -> None:
    """Across chunked prefill, accepted and rejected drafts, every draft the engine proposes is the one
    the MTP module gives when run over the whole sequence at once: no position of its cache is missing
    or stale."""
    folder = request.getfixturevalue(checkpoint)
    llm = _llm(folder, 3, long_prefill_token_threshold=7, max_num_batched_tokens=16)
    engine = llm.engine
    real = engine.executor.propose
    seen: list[tuple[list[int], list[int]]] = []

    def propose(inputs):
        drafts = real(inputs)
        for inp, made in zip(inputs, drafts, strict=True):
            if made:
                seen.append((list(engine.scheduler.get_request(inp.request_id).all_token_ids), made))
        return drafts

    monkeypatch.setattr(engine.executor, "propose", propose)
    outs = generate(
        llm, random_prompts(8, [19, 4, 11]), SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    )
    assert sum(o.metrics.spec_draft_tokens for o in outs) > 0
    compared = 0
    for tokens, made in seen:
        ref, gap = _reference_drafts(engine.executor.runner.model, tokens, len(made))
        if gap > 1e-3:  # a near tie may flip under a different summation order
            assert made == ref, f"after {len(tokens)} tokens"
            compared += 1
    assert compared >= 0.9 * len(seen) and compared > 20


def test_structured_outputs_with_accepted_drafts(tiny_deepseek: Path, base: LLM) -> None:
    """A grammar under speculative decoding: the verification samples round by round, each row masked by
    the matcher after the tokens appended before it, so drafts forced right (and accepted) give the answer
    of plain decoding, and a wrong draft the grammar forbids is never accepted."""
    import json

    from pegainfer import StructuredOutputsParams

    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999}, "b": {"enum": ["x", "yz"]}},
        "required": ["a", "b"],
        "additionalProperties": False,
    }
    params = SamplingParams(
        temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=schema)
    )
    prompts = random_prompts(7, [9, 4])
    ref = generate(base, prompts, params)
    # Past the answer's end the drafts are filler: the grammar's end finishes the request first.
    truth = {tuple(p): p + r.outputs[0].token_ids + [0] * 8 for p, r in zip(prompts, ref, strict=True)}
    for right in (None, 0):
        llm = _llm(tiny_deepseek, 2)
        force_drafts(llm, truth, right)
        outs, stats = generate_counting(llm, prompts, params)
        assert token_ids(outs) == token_ids(ref)
        assert all(json.loads(o.outputs[0].text)["b"] in ("x", "yz") for o in outs)
        assert (stats["spec_accepted_tokens"] > 0) == (right is None)


def test_prompt_lookup_drafts_without_the_mtp_layer(aligned_deepseek: Path) -> None:
    """Prompt lookup (the MTP layer not built) on the near-bigram checkpoint, whose answers fall into loops:
    its drafts, right and wrong, verify through the same MLA + MoE forward."""
    base = _llm(aligned_deepseek)
    prompts = echoing_prompts(base, 6, [5, 17, 9])
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    llm = _llm(aligned_deepseek, 3, speculative_method="ngram")
    assert llm.engine.executor.runner.model.num_mtp_layers == 0
    outs, stats = generate_counting(llm, prompts, params)
    assert token_ids(outs) == token_ids(generate(base, prompts, params))
    assert stats["spec_draft_tokens"] > stats["spec_accepted_tokens"] > 0
