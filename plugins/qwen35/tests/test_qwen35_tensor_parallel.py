"""Qwen3.5 over two tensor-parallel ranks (gloo, CPU, float32): the same tokens as transformers and as one
rank, dense and MoE, with the async decode-graph path, chunked prefill and preemption (the GDN slot states
and the paged KV cache are the ranks' own shards), and MTP drafting, whose rejected drafts each rank rolls
back out of its own share of the recurrent state."""

from __future__ import annotations

from pathlib import Path

import pytest

from pegainfer import LLM, SamplingParams
from pegainfer.testing.conformance import assert_tensor_parallel_matches, random_prompts

pytestmark = pytest.mark.slow


def test_tied_with_fewer_kv_heads_than_ranks(tiny_checkpoint_factory):
    # One full-attention kv head, replicated on both ranks; tied embeddings over a vocabulary the ranks do
    # not divide (the last rank's rows are zero padding).
    folder = tiny_checkpoint_factory(
        "qwen3_5", num_key_value_heads=1, tie_word_embeddings=True, vocab_size=1001, seed=3
    )
    assert_tensor_parallel_matches(folder, async_scheduling=True)


def _steps(folder: Path, tp: int, k: int, prompts: list[list[int]]) -> tuple[list[list[int]], dict]:
    llm = LLM(
        str(folder),
        dtype="float32",
        device="cpu",
        cpu_kv_cache_bytes=32 << 20,
        tensor_parallel_size=tp,
        speculative_num_tokens=k,
    )
    try:
        outs = llm.generate(
            prompt_token_ids=prompts,
            sampling_params=SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
            use_tqdm=False,
        )
        llm.engine.buffers.check_invariants()
        return [o.outputs[0].token_ids for o in outs], dict(llm.engine.stats)
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("architecture", ["qwen3_5"], indirect=True, scope="session")
def test_drafting_rolls_each_ranks_state_back(aligned_qwen35: Path) -> None:
    """Two ranks drafting with a mostly right MTP module give one rank's greedy tokens without drafting,
    and accept exactly the drafts one rank drafting does (so each roll-back restored the same state)."""
    prompts = random_prompts(5, [5, 17, 30])
    ref, _ = _steps(aligned_qwen35, 1, 0, prompts)
    one, one_stats = _steps(aligned_qwen35, 1, 2, prompts)
    two, stats = _steps(aligned_qwen35, 2, 2, prompts)
    assert two == one == ref
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"], "rolled back, and not every time"
    assert (stats["spec_draft_tokens"], stats["spec_accepted_tokens"]) == (
        one_stats["spec_draft_tokens"],
        one_stats["spec_accepted_tokens"],
    )
