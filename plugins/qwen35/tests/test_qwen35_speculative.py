"""MTP speculative decoding of Qwen3.5 end to end (float32, CPU; dense and MoE).

Qwen3.5 keeps recurrent state (each GDN layer's conv window and delta-rule state), which a verification
advances over every draft. A rejection rolls it back: the verification chunk's forward saves the state
after the known token and after each draft but the last into the slot's roll-back snapshots, and the
next step restores the one of the accepted count (``docs/speculative.md``). The invariant: greedy output
with ``speculative.num_tokens=k`` is token for token the output without it. Random MTP weights reject
nearly every draft; forced drafts (all, some or none right) reach each roll-back point, and an aligned
checkpoint (the main model nearly a bigram model, the MTP module its copy) shows the real MTP path
drafting the target.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch

from pegainfer import LLM
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
    kw.setdefault("cpu_kv_cache_bytes", 32 << 20)
    return LLM(str(folder), dtype="float32", device="cpu", speculative_num_tokens=k, **kw)


@pytest.fixture(scope="module")
def base(tiny_qwen35: Path) -> LLM:
    return _llm(tiny_qwen35)


# ------------------------------------------------------------------------------------------ the plan


def test_drafting_reserves_a_roll_back_snapshot_per_draft_and_the_mtp_cache(tiny_qwen35: Path) -> None:
    engine = _llm(tiny_qwen35, 3, max_num_seqs=5).engine
    plan = engine.executor.plan
    assert engine.executor.capabilities.max_speculative_tokens == 3
    assert plan.draft_snapshots_per_slot == 3 and plan.num_cache_snapshots > 0
    assert plan.num_snapshot_slots == 5 * 3 + plan.num_cache_snapshots
    assert 4 in engine.executor.runner.buffers.caches, "the MTP layer's KV cache (layer num_hidden_layers)"
    buffers = engine.buffers
    assert buffers.caching and buffers.snapshots.first == 15, "prefix caching keeps the snapshots after them"


def test_prefix_caching_beside_drafting_gives_the_uncached_tokens(tiny_qwen35: Path) -> None:
    """Prefix caching (snapshots every 8 tokens) and drafting (forced to accept one of two drafts, so every
    verification rolls back) share the snapshot pool: a repeated prompt, prompts sharing part of it, and a
    second turn whose prompt holds the first turn's answer hit cached pages and restore cached states, and
    every request's tokens are those of a run with neither."""
    from pegainfer.config.compose import build_engine_config, compose

    def llm(*overrides: str) -> LLM:
        small = [
            f"model.path={tiny_qwen35}", "model.dtype=float32", "model.max_model_len=128", "device=cpu",
            "cache.block_size=4", "cache.snapshot_interval_pages=2", f"cache.cpu_kv_cache_bytes={32 << 20}",
        ]  # fmt: skip
        return LLM.from_config(build_engine_config(compose("generate", [*small, *overrides])))

    base = random_prompts(11, [30])[0]
    plain = llm("cache.enable_prefix_caching=false")
    first = token_ids(generate(plain, [base]))[0]
    rounds = [[base], [base[:n] + random_prompts(n, [5])[0] for n in (9, 17, 26)], [base + first + [7, 8, 9]]]
    expected = [token_ids(generate(plain, r)) for r in rounds]
    truth = {
        tuple(p): p + out
        for r, outs in zip(rounds, expected, strict=True)
        for p, out in zip(r, outs, strict=True)
    }
    both = llm("speculative.num_tokens=2")
    assert both.engine.buffers.caching and both.engine.executor.plan.draft_snapshots_per_slot == 2
    force_drafts(both, truth, 1)
    cached = []
    for r, want in zip(rounds, expected, strict=True):
        outs = generate(both, r)
        assert token_ids(outs) == want
        cached.append([o.num_cached_tokens for o in outs])
        both.engine.buffers.check_invariants()
    assert all(c > 0 for c in cached[1]), f"no hits where expected: {cached}"
    # The second turn resumes at the first turn's prompt's last full page: the boundaries inside its drafted
    # answer got no snapshot (verification chunks take none, see PagedBufferManager.plan_snapshots).
    assert cached[2] == [(len(base) - 1) // 4 * 4]
    assert both.engine.stats["spec_accepted_tokens"] > 0


# --------------------------------------------------------------------------------- output invariance


@pytest.mark.parametrize("k", [1, 2])
def test_batch_of_mixed_lengths_output_unchanged(tiny_qwen35: Path, base: LLM, k: int) -> None:
    llm = _llm(tiny_qwen35, k)
    prompts = random_prompts(1, [1, 5, 17, 33, 2, 64])
    outs, stats = generate_counting(llm, prompts)
    assert token_ids(outs) == token_ids(generate(base, prompts))
    assert stats["spec_draft_tokens"] > 0


@pytest.mark.parametrize("k", [1, 3])
def test_chunked_prefill_output_unchanged(tiny_qwen35: Path, base: LLM, k: int) -> None:
    # Chunks of at most 5 tokens, 8 tokens a step: drafts are cut or dropped when the budget is short.
    llm = _llm(tiny_qwen35, k, long_prefill_token_threshold=5, max_num_batched_tokens=8)
    prompts = random_prompts(2, [45, 30, 9])
    assert token_ids(generate(llm, prompts)) == token_ids(generate(base, prompts))


@pytest.mark.parametrize("k", [1, 3])
def test_preempted_output_unchanged(tiny_qwen35: Path, base: LLM, k: int) -> None:
    llm = _llm(tiny_qwen35, k, block_size=4, num_gpu_blocks_override=24, max_model_len=64)
    prompts = random_prompts(3, [16, 12, 15, 14])
    outs = generate(llm, prompts)
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert token_ids(outs) == token_ids(generate(base, prompts))
    llm.engine.buffers.check_invariants()


def test_logprobs_and_sampled_requests_unchanged(tiny_qwen35: Path, base: LLM) -> None:
    prompts = random_prompts(4, [7, 13])
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    sampled = SamplingParams(temperature=0.9, top_k=50, seed=7, max_tokens=12, ignore_eos=True)
    ours = _llm(tiny_qwen35, 2).generate(
        prompt_token_ids=prompts, sampling_params=[greedy, sampled], use_tqdm=False
    )
    ref = base.generate(prompt_token_ids=prompts, sampling_params=[greedy, sampled], use_tqdm=False)
    assert token_ids(ours) == token_ids(ref)
    assert ours[0].metrics.spec_draft_tokens > 0 and ours[1].metrics.spec_draft_tokens == 0
    for a, b in zip(ours[0].outputs[0].logprobs, ref[0].outputs[0].logprobs, strict=True):
        assert a.keys() == b.keys()
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 and a[t].rank == b[t].rank for t in a)


# ------------------------------------------------------------------- every roll-back point, forced


@pytest.mark.parametrize(
    ("right", "k"),
    [(None, 1), (None, 3), (0, 1), (0, 3), (1, 3), (2, 3)],
    ids=["all-of-1", "all-of-3", "none-of-1", "none-of-3", "one-of-3", "two-of-3"],
)
def test_forced_drafts_roll_the_state_back_to_what_was_accepted(
    tiny_qwen35: Path, base: LLM, right, k: int
) -> None:
    """Each verifying step accepts ``right`` drafts (all with None) and appends one more token: the state
    restored from the snapshot of that many drafts must continue as if they alone had been decoded."""
    prompts = random_prompts(6, [9, 21])
    ref = generate(base, prompts)
    truth = {tuple(p): p + o.outputs[0].token_ids for p, o in zip(prompts, ref, strict=True)}
    llm = _llm(tiny_qwen35, k)
    force_drafts(llm, truth, right)
    outs, stats = generate_counting(llm, prompts)
    assert token_ids(outs) == token_ids(ref)
    per_step = k + 1 if right is None else right + 1
    assert stats["steps"] == 1 + -(-23 // per_step), "one prefill step, then per_step tokens a step"
    accepted, verifying = stats["spec_accepted_tokens"], len(prompts) * (stats["steps"] - 1)
    if right is None:
        assert accepted == stats["spec_draft_tokens"]
    else:  # the last verification may hold fewer drafts than right (never past max_tokens)
        assert right * (verifying - len(prompts)) <= accepted <= right * verifying


def test_verification_on_the_prefill_graph_path(tiny_qwen35: Path, base: LLM) -> None:
    """Verification chunks (their roll-back states saved) on the bucket-padded prefill-graph path."""
    assert_verification_on_prefill_graphs(partial(_llm, tiny_qwen35), base, random_prompts(7, [9, 21, 4]))


def test_padding_rows_route_as_row_zero_on_the_prefill_graph_path(
    tiny_qwen35: Path, architecture: str, base: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three requests verifying one draft each are six tokens in the 8-token prefill graph: its two
    padding rows take row 0's experts in every MoE layer, the MTP layer's included (routing.py), and the
    output stays the plain path's."""
    if architecture != "qwen3_5_moe":
        pytest.skip("the dense model routes nothing")
    import pegainfer_qwen35.moe as moe

    padded: list[int] = []
    select = moe.softmax_topk

    def check(logits, k, norm, dtype, shared, real_rows=None):
        weights, ids = select(logits, k, norm, dtype, shared, real_rows)
        if real_rows is not None and int(real_rows) < ids.shape[0]:
            n = int(real_rows)
            assert torch.equal(ids[n:], ids[:1].expand(ids.shape[0] - n, -1))
            padded.append(ids.shape[0] - n)
        return weights, ids

    monkeypatch.setattr(moe, "softmax_topk", check)
    llm = _llm(tiny_qwen35, 1)
    llm.engine.executor.capture_cuda_graphs(eager=True)
    prompts = random_prompts(8, [6, 11, 19])
    assert token_ids(generate(llm, prompts)) == token_ids(generate(base, prompts))
    assert 2 in padded, f"padding rows seen: {sorted(set(padded))}"


def test_draft_passes_on_the_graph_path(tiny_qwen35: Path) -> None:
    """The MTP passes on the draft graphs propose the plain path's drafts (the hidden-state half too)."""
    assert_draft_passes_on_graph_path(partial(_llm, tiny_qwen35), random_prompts(5, [5, 17, 3, 30]))


# ---------------------------------------------------------------------------- the real MTP path drafts


@pytest.mark.parametrize("k", [1, 3])
def test_aligned_mtp_drafts_are_accepted(aligned_qwen35: Path, k: int) -> None:
    prompts = random_prompts(5, [5, 17, 3, 30])
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    ref, ref_stats = generate_counting(_llm(aligned_qwen35), prompts, params)
    outs, stats = generate_counting(_llm(aligned_qwen35, k), prompts, params)
    assert token_ids(outs) == token_ids(ref)
    rate = stats["spec_accepted_tokens"] / stats["spec_draft_tokens"]
    print(f"aligned MTP, k={k}: acceptance {rate:.2f}, steps {stats['steps']} (without {ref_stats['steps']})")
    assert rate > 0.25
    assert stats["steps"] < ref_stats["steps"] - 3


@pytest.mark.parametrize("k", [2, 3])
def test_prompt_lookup_drafts_roll_the_state_back_unchanged(aligned_qwen35: Path, k: int) -> None:
    """Prompt lookup (no MTP layer built) on the near-bigram checkpoint, whose answers fall into loops: its
    drafts are right and wrong, so verification rolls the recurrent state back to every accepted count,
    with chunked prefill beside it."""
    base = _llm(aligned_qwen35)
    prompts = echoing_prompts(base, 6, [5, 17, 9])
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    llm = _llm(aligned_qwen35, k, speculative_method="ngram", long_prefill_token_threshold=7)
    assert llm.engine.executor.runner.model.num_mtp_layers == 0
    outs, stats = generate_counting(llm, prompts, params)
    assert token_ids(outs) == token_ids(generate(base, prompts, params))
    assert stats["spec_draft_tokens"] > stats["spec_accepted_tokens"] > 0
    llm.engine.buffers.check_invariants()
