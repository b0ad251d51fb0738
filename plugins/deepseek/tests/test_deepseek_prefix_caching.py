"""Prefix caching for DeepSeek: with MTP drafting, a hit's cached pages hold the draft layer's KV too (keyed
with the token after each page), so every draft is the one an uncached run proposes; DeepSeek-V4 refuses
prefix caching with a reason, logged once, and runs uncached."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from pegainfer import LLM
from pegainfer.engine import llm_engine
from pegainfer.sampling.sampling_params import SamplingParams
from pegainfer.testing.conformance import random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def _drafting_run(folder: Path, caching: bool, rounds: list[list[list[int]]]):
    llm = LLM(
        str(folder),
        dtype="float32",
        device="cpu",
        cpu_kv_cache_bytes=8 << 20,
        speculative_num_tokens=2,
        block_size=4,
        enable_prefix_caching=caching,
    )
    engine = llm.engine
    real = engine.executor.propose
    drafts: list[list[int]] = []

    def propose(inputs):
        made = real(inputs)
        drafts.extend(made)
        return made

    engine.executor.propose = propose
    outs = [llm.generate(prompt_token_ids=r, sampling_params=GREEDY, use_tqdm=False) for r in rounds]
    engine.buffers.check_invariants()
    return outs, drafts, engine


def test_hits_keep_the_draft_layer_kv(tiny_deepseek: Path) -> None:
    base = random_prompts(3, [19])[0]
    # The base, then prompts sharing 8..18 of its tokens (one batch), then a sampled one (keyed apart).
    rounds = [[base], [base[:k] + [5, 6, 7] for k in (8, 9, 12, 16, 18)], [base]]
    ref, ref_drafts, _ = _drafting_run(tiny_deepseek, False, rounds)
    outs, drafts, engine = _drafting_run(tiny_deepseek, True, rounds)
    assert [[o.outputs[0].token_ids for o in r] for r in outs] == [
        [o.outputs[0].token_ids for o in r] for r in ref
    ]
    assert drafts == ref_drafts, "a hit's draft-layer KV differs from the uncached run's"
    # A drafting page's key includes the token after it: sharing k tokens hits the pages ending before k.
    assert [o.num_cached_tokens for o in outs[1]] == [4, 8, 8, 12, 16]
    assert outs[2][0].num_cached_tokens == 16
    assert engine.buffers.prefix_cache_stats[1] == sum(o.num_cached_tokens for r in outs for o in r)


def test_sampled_pages_are_keyed_apart_from_drafted_ones(aligned_deepseek: Path) -> None:
    """A sampled request does not draft, so its pages hold no draft-layer KV: a greedy (drafting) request
    never hits them, another sampled one does."""
    _, _, engine = _drafting_run(aligned_deepseek, True, [])
    llm = LLM.__new__(LLM)
    llm.engine, llm._ids = engine, iter(range(100))
    prompt = random_prompts(6, [13])[0]
    sampled = SamplingParams(temperature=0.8, seed=1, max_tokens=3)
    llm.generate(prompt_token_ids=[prompt], sampling_params=sampled, use_tqdm=False)
    greedy = llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY, use_tqdm=False)
    again = llm.generate(prompt_token_ids=[prompt], sampling_params=sampled, use_tqdm=False)
    assert greedy[0].num_cached_tokens == 0 and again[0].num_cached_tokens == 12


def test_v4_refuses_prefix_caching_once(
    tiny_checkpoint_factory: Callable[..., Path], caplog, monkeypatch
) -> None:
    folder = tiny_checkpoint_factory("deepseek_v4")
    monkeypatch.setattr(llm_engine, "_LOGGED_REFUSALS", set())
    with caplog.at_level(logging.WARNING, logger="pegainfer.engine.llm_engine"):
        llms = [LLM(str(folder), dtype="float32", device="cpu", cpu_kv_cache_bytes=8 << 20) for _ in range(2)]
    refusals = [r for r in caplog.records if "without prefix caching" in r.getMessage()]
    assert len(refusals) == 1 and "compressed entry" in refusals[0].getMessage()
    prompt = random_prompts(4, [20])[0]
    for llm in llms:
        assert not llm.engine.buffers.caching and llm.engine.executor.plan.num_snapshot_slots == 0
        outs = [
            llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY, use_tqdm=False) for _ in range(2)
        ]
        assert outs[0][0].outputs[0].token_ids == outs[1][0].outputs[0].token_ids
        assert outs[1][0].num_cached_tokens == 0
