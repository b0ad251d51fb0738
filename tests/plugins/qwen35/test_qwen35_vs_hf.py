"""Qwen3.5 (dense and MoE) on the reference path against HF transformers, float32: greedy tokens identical
(single, batched, chunked prefill across conv windows, preempted and resumed), logits within 1e-4."""

from __future__ import annotations

import pytest
import torch

from pegainfer import LLM, SamplingParams
from pegainfer.executor import ModelBatch, SequenceChunk
from pegainfer.request import Request
from pegainfer.testing.conformance import (
    assert_chunked_prefill_matches_hf,
    assert_preempted_run_matches_hf,
    greedy_token_ids,
    hf_greedy,
    hf_logits,
    random_prompts,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_qwen35):
    return LLM(str(tiny_qwen35), dtype="float32", device="cpu", cpu_kv_cache_bytes=8 << 20)


def test_single_prompt_matches_hf(llm, tiny_qwen35):
    prompts = random_prompts(0, [11])
    assert greedy_token_ids(llm, prompts) == hf_greedy(tiny_qwen35, prompts, 24)


def test_batch_of_mixed_lengths_matches_hf(llm, tiny_qwen35):
    # 1-token prompts run as decode rows from a zero state; 70 tokens span two delta-rule blocks of 64.
    prompts = random_prompts(1, [1, 5, 17, 33, 2, 70])
    assert greedy_token_ids(llm, prompts) == hf_greedy(tiny_qwen35, prompts, 24)
    llm.engine.buffers.check_invariants()


def test_chunked_prefill_matches_hf(tiny_qwen35):
    # Chunks of 3 tokens (shorter than the conv window of 4) and a 10-token step budget: every chunk
    # continues the previous chunk's conv window and delta-rule state, and steps mix prefill chunks with
    # decode rows.
    assert_chunked_prefill_matches_hf(tiny_qwen35, chunk=3, budget=10, lengths=[25, 13, 7, 2])


def test_preempted_run_matches_hf(tiny_qwen35):
    # 20 pages of 4 tokens cannot hold four ~40-token sequences at once: the scheduler must preempt.
    llm = assert_preempted_run_matches_hf(tiny_qwen35, pages=20)
    # Recurrent-state slots come back too: a preempted request recomputes from a fresh (zeroed) slot.
    assert llm.engine.buffers.num_active == 0


def _relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return (torch.linalg.vector_norm(ours - ref) / torch.linalg.vector_norm(ref)).item()


def test_prompt_logits_within_tolerance(llm, tiny_qwen35):
    prompt = random_prompts(4, [29])[0]
    engine = llm.engine
    request = Request("logits-probe", prompt, GREEDY)
    assert engine.buffers.allocate_slots(request, len(prompt))
    try:
        chunk = SequenceChunk(
            "logits-probe",
            prompt,
            0,
            engine.buffers.block_table("logits-probe"),
            state_slot=engine.buffers.state_slot("logits-probe"),
            needs_logits=True,
            all_logits=True,
        )
        out = engine.executor.execute(ModelBatch([chunk]))
    finally:
        engine.buffers.free(request)
    ref = hf_logits(tiny_qwen35, prompt)
    last, full = _relative_error(out.logits[0], ref[-1]), _relative_error(out.all_logits["logits-probe"], ref)
    print(f"relative logit error vs transformers: last position {last:.2e}, all positions {full:.2e}")
    assert last < 1e-4 and full < 1e-4
