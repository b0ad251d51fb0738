"""MTP drafting for DeepSeek-V3.2 (float32, CPU): its MTP layer carries a DSA indexer of its own, with an
indexer key cache beside its latent cache. Greedy output with drafting is the output without it (single,
batched, chunked, k = 1 and 3), and on an aligned checkpoint (a near-bigram model whose MTP layer is that
bigram) its drafts are accepted."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest

from pegainfer import LLM
from pegainfer.testing.conformance import SamplingParams, random_prompts
from pegainfer.testing.speculative import (
    assert_draft_passes_on_graph_path,
    assert_verification_on_prefill_graphs,
    generate,
    generate_counting,
    token_ids,
)
from pegainfer_deepseek.indexer import INDEXER_CACHE


def _llm(folder: Path, k: int = 0, **kw: object) -> LLM:
    kw.setdefault("cpu_kv_cache_bytes", 8 << 20)
    return LLM(str(folder), dtype="float32", device="cpu", speculative_num_tokens=k, **kw)


@pytest.fixture(scope="module")
def v32_mtp(tiny_checkpoint_factory: Callable[..., Path]) -> Path:
    return tiny_checkpoint_factory("deepseek_v32", num_nextn_predict_layers=1)


@pytest.fixture(scope="module")
def base(v32_mtp: Path) -> LLM:
    return _llm(v32_mtp)


def test_drafting_adds_the_mtp_layers_latent_and_indexer_caches(v32_mtp: Path, base: LLM) -> None:
    assert sorted(map(str, base.engine.executor.runner.buffers.caches)) == sorted(
        map(str, [0, 1, 2, *((layer, INDEXER_CACHE) for layer in range(3))])
    )
    caches = _llm(v32_mtp, 1).engine.executor.runner.buffers.caches
    assert {3, (3, INDEXER_CACHE)} <= set(caches)


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_output_unchanged(v32_mtp: Path, base: LLM, k: int) -> None:
    """Mixed lengths (some past the indexer's top-k of 4 positions, so selection matters), whole and in
    5-token chunks."""
    prompts = random_prompts(1, [1, 5, 17, 33])
    expected = token_ids(generate(base, prompts))
    assert token_ids(generate(_llm(v32_mtp, k), prompts)) == expected
    chunked = _llm(v32_mtp, k, max_num_batched_tokens=5, long_prefill_token_threshold=5)
    assert token_ids(generate(chunked, prompts)) == expected


def test_verification_on_the_prefill_graph_path(v32_mtp: Path, base: LLM) -> None:
    """Verification chunks on the bucket-padded prefill-graph path: every token a decode row, its indexer
    ranking its own causal context as a decode row's does."""
    assert_verification_on_prefill_graphs(partial(_llm, v32_mtp), base, random_prompts(7, [9, 21, 4]))


def test_draft_passes_on_the_graph_path(v32_mtp: Path) -> None:
    """The MTP passes on the draft graphs (its indexer over its own key cache) propose the plain path's
    drafts."""
    assert_draft_passes_on_graph_path(partial(_llm, v32_mtp), random_prompts(5, [5, 17, 3, 30]))


def test_aligned_mtp_drafts_are_accepted(aligned_v32: Path) -> None:
    prompts = random_prompts(5, [5, 17, 3, 30])
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    ref, ref_stats = generate_counting(_llm(aligned_v32), prompts, params)
    outs, stats = generate_counting(_llm(aligned_v32, 2), prompts, params)
    assert token_ids(outs) == token_ids(ref)
    rate = stats["spec_accepted_tokens"] / stats["spec_draft_tokens"]
    print(
        f"aligned V3.2 MTP, k=2: acceptance {rate:.2f}, steps {stats['steps']} (without {ref_stats['steps']})"
    )
    assert rate > 0.25
    assert stats["steps"] < ref_stats["steps"] - 3
