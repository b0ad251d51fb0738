"""Prompt lookup (``speculative.method=ngram``): the lookup against a brute-force search, and greedy output
with its drafts token for token the output without them (batched, chunked prefill, preemption, logprobs),
on the tiny Qwen3 model. Qwen3.5's recurrent state and DeepSeek's MTP-less use are in their plugins."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from pegainfer import LLM, SamplingParams
from pegainfer.errors import ConfigError
from pegainfer.scheduling.prompt_lookup import PromptLookup
from pegainfer.testing.conformance import random_prompts
from pegainfer.testing.speculative import echoing_prompts, generate, generate_counting, token_ids


def _brute(tokens: list[int], n_min: int, n_max: int, k: int) -> list[int]:
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


@pytest.mark.parametrize(("n_min", "n_max"), [(1, 1), (2, 4), (1, 3), (3, 3)])
def test_lookup_matches_a_brute_force_search_as_the_sequence_grows(n_min: int, n_max: int) -> None:
    rng = random.Random(n_min * 10 + n_max)
    for trial in range(30):
        vocab = rng.choice([2, 3, 5, 50])
        lookup, tokens = PromptLookup(n_min, n_max), []
        for _ in range(rng.randrange(1, 40)):
            tokens += [rng.randrange(vocab) for _ in range(rng.randrange(0, 30 if trial % 7 == 0 else 4))]
            k = rng.randrange(0, 6)
            assert lookup.drafts(tokens, k) == _brute(tokens, n_min, n_max, k), (tokens, k)


def test_the_longest_suffix_and_the_latest_occurrence_win() -> None:
    lookup = PromptLookup(1, 3)
    # "7 8 9" occurred once (followed by 1); "8 9" later (followed by 2): the longer suffix decides.
    assert lookup.drafts([7, 8, 9, 1, 5, 8, 9, 2, 7, 8, 9], 2) == [1, 5]
    # Only "9": its latest earlier occurrence, cut where the sequence ends.
    assert PromptLookup(1, 3).drafts([9, 4, 9, 6, 9], 3) == [6, 9]
    assert PromptLookup(2, 3).drafts([1, 2, 3, 4], 3) == []


# ------------------------------------------------------------------------------------ through the engine


def _llm(folder: Path, k: int = 0, **kw: object) -> LLM:
    kw.setdefault("cpu_kv_cache_bytes", 16 << 20)
    return LLM(
        str(folder), dtype="float32", device="cpu", speculative_num_tokens=k, speculative_method="ngram", **kw
    )


@pytest.fixture(scope="module")
def base(tiny_qwen3: Path) -> LLM:
    return _llm(tiny_qwen3)


@pytest.mark.parametrize("k", [1, 3])
def test_batch_of_mixed_lengths_output_unchanged(tiny_qwen3: Path, base: LLM, k: int) -> None:
    prompts = echoing_prompts(base, 1, [1, 5, 17, 33]) + random_prompts(2, [2, 40])
    outs, stats = generate_counting(_llm(tiny_qwen3, k), prompts)
    assert token_ids(outs) == token_ids(generate(base, prompts))
    assert stats["spec_draft_tokens"] > stats["spec_accepted_tokens"] > 0
    assert sum(o.metrics.spec_accepted_tokens for o in outs) == stats["spec_accepted_tokens"]


@pytest.mark.parametrize("k", [2, 4])
def test_chunked_prefill_and_preemption_output_unchanged(tiny_qwen3: Path, base: LLM, k: int) -> None:
    prompts = echoing_prompts(base, 3, [6, 5, 7, 4])
    chunked = _llm(tiny_qwen3, k, long_prefill_token_threshold=5, max_num_batched_tokens=8)
    assert token_ids(generate(chunked, prompts)) == token_ids(generate(base, prompts))
    tight = _llm(tiny_qwen3, k, block_size=4, num_gpu_blocks_override=24, max_model_len=96)
    outs = generate(tight, prompts)
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert token_ids(outs) == token_ids(generate(base, prompts))
    tight.engine.buffers.check_invariants()


def test_logprobs_and_sampled_requests_unchanged(tiny_qwen3: Path, base: LLM) -> None:
    prompts = echoing_prompts(base, 4, [7, 13])
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3)
    sampled = SamplingParams(temperature=0.9, top_k=50, seed=7, max_tokens=16, ignore_eos=True)
    ours = generate(_llm(tiny_qwen3, 2), prompts, [greedy, sampled])
    ref = generate(base, prompts, [greedy, sampled])
    assert token_ids(ours) == token_ids(ref)
    assert ours[0].metrics.spec_draft_tokens > 0 and ours[1].metrics.spec_draft_tokens == 0
    for a, b in zip(ours[0].outputs[0].logprobs, ref[0].outputs[0].logprobs, strict=True):
        assert a.keys() == b.keys()
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 and a[t].rank == b[t].rank for t in a)


def test_a_reversed_lookup_range_is_refused_naming_the_keys(tiny_qwen3: Path) -> None:
    with pytest.raises(ConfigError, match="prompt_lookup_min"):
        _llm(tiny_qwen3, 2, prompt_lookup_min=5, prompt_lookup_max=3)


def test_two_ranks_verify_the_drafts_as_one_does(tiny_qwen3: Path, base: LLM) -> None:
    """Tensor parallel (2 ranks, gloo): the drafts are made on the host once, every rank verifies them."""
    prompts = echoing_prompts(base, 7, [5, 17, 9])
    llm = _llm(tiny_qwen3, 3, tensor_parallel_size=2)
    try:
        outs, stats = generate_counting(llm, prompts)
        assert token_ids(outs) == token_ids(generate(base, prompts))
        assert stats["spec_accepted_tokens"] > 0
        llm.engine.buffers.check_invariants()
    finally:
        llm.engine.shutdown()
