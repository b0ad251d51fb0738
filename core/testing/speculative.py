"""Drafts forced right or wrong, whatever the MTP module proposes (tests and benchmarks).

A plugin's tests check that greedy output with drafts equals the output without them. With random MTP
weights every draft is rejected, so the roll-back paths a partly accepted verification takes are only
reached by replacing the drafts: ``force_drafts`` keeps the engine's real ``propose`` (it fills the MTP
cache) and swaps the tokens it returns for the target's own continuation, all or only the first few.
A benchmark uses the same to time drafting at a known acceptance on random weights.
"""

from __future__ import annotations

from typing import Any

from pegainfer.sampling.sampling_params import SamplingParams
from pegainfer.testing.conformance import random_prompts

#: Greedy decoding of 24 tokens past any stop token: what drafting must leave unchanged.
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def generate(llm: Any, prompts: list[list[int]], params: SamplingParams | list = GREEDY) -> list:
    """``llm.generate`` of token-id ``prompts``, without a progress bar."""
    return llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)


def token_ids(outs: list) -> list[list[int]]:
    """The generated token ids of each request's first completion."""
    return [o.outputs[0].token_ids for o in outs]


def generate_counting(
    llm: Any, prompts: list[list[int]], params: SamplingParams = GREEDY
) -> tuple[list, dict[str, int]]:
    """``generate``, and how much each engine counter (steps, drafted and accepted tokens) grew meanwhile."""
    before = dict(llm.engine.stats)
    outs = generate(llm, prompts, params)
    return outs, {key: llm.engine.stats[key] - before[key] for key in before}


def echoing_prompts(base: Any, seed: int, lengths: list[int]) -> list[list[int]]:
    """Random prompts that hold their own greedy continuation once already (prompt, answer, prompt again):
    the answer tends to repeat it, so prompt lookup (``speculative.method=ngram``) finds drafts that are
    right and drafts that are wrong."""
    prompts = random_prompts(seed, lengths)
    answers = token_ids(generate(base, prompts))
    return [p + a + p for p, a in zip(prompts, answers, strict=True)]


def force_drafts(llm: Any, truth: dict[tuple[int, ...], list[int]], right: int | None) -> None:
    """Make the drafts of ``llm`` (an ``LLM``, changed for good) for a prompt the continuation
    ``truth[prompt]`` (prompt then output), the first ``right`` of each step's drafts right and the rest
    wrong (``right=None``: all right)."""
    engine = llm.engine
    real = engine.executor.propose
    vocab = engine.executor.runner.model.vocab_size

    def propose(inputs):
        out = []
        for inp, made in zip(inputs, real(inputs), strict=True):
            req = engine.scheduler.get_request(inp.request_id)
            seq = truth[tuple(req.prompt_token_ids)]
            drafts = seq[req.num_tokens : req.num_tokens + len(made)]
            assert len(drafts) == len(made), "a draft past max_tokens"
            keep = len(drafts) if right is None else right
            out.append(drafts[:keep] + [(t + 1) % vocab for t in drafts[keep:]])
        return out

    engine.executor.propose = propose


def _recording(graphs: Any, what: Any) -> list:
    """Route ``graphs.run`` (a ``PrefillGraphs``, changed for good) through a recorder of ``what(chunks)``
    per step; returns the list it fills."""
    seen: list = []
    run = graphs.run

    def recording_run(chunks, state_slots, checkpoints):
        seen.append(what(chunks))
        return run(chunks, state_slots, checkpoints)

    graphs.run = recording_run
    return seen


def assert_verification_on_prefill_graphs(make_llm: Any, base: Any, prompts: list[list[int]]) -> None:
    """The GPU's verification path, run eagerly: with ``make_llm(3)`` (an ``LLM`` drafting 3 tokens) on
    its graph paths, each verification chunk (its known token and drafts sampled, its hidden states kept for
    the MTP pass, any roll-back states saved) is a bucket-padded prefill-graph step, and drafts forced to
    accept one of three give ``base``'s tokens (a run without drafting)."""
    ref = generate(base, prompts)
    llm = make_llm(3)
    llm.engine.executor.capture_cuda_graphs(eager=True)
    graphs = llm.engine.executor.runner.prefill_graphs
    assert graphs.inputs.rows_per_segment == 4
    sampled = _recording(graphs, lambda chunks: [c.num_logits for c in chunks])
    force_drafts(llm, {tuple(p): p + o.outputs[0].token_ids for p, o in zip(prompts, ref, strict=True)}, 1)
    assert token_ids(generate(llm, prompts)) == token_ids(ref)
    assert sum(4 in s for s in sampled) >= 8, "verification steps did not take the prefill graphs"
    llm.engine.buffers.check_invariants()


def assert_draft_passes_on_graph_path(make_llm: Any, prompts: list[list[int]]) -> None:
    """The GPU's draft path, run eagerly: the MTP pass over a step's kept positions and each chained draft
    of ``make_llm(3)`` replay the draft graphs (short segments, then one-token segments) and propose
    exactly the drafts the plain path proposes, step by step, for the same tokens."""

    def proposals(llm: Any) -> list:
        made, propose = [], llm.engine.executor.propose

        def recording(inputs):
            drafts = propose(inputs)
            made.append(drafts)
            return drafts

        llm.engine.executor.propose = recording
        return made

    plain = make_llm(3)
    plain_drafts = proposals(plain)
    plain_tokens = token_ids(generate(plain, prompts))
    llm = make_llm(3)
    llm.engine.executor.capture_cuda_graphs(eager=True)
    passes = _recording(
        llm.engine.executor.runner.draft_graphs, lambda chunks: [len(c.token_ids) for c in chunks]
    )
    graph_drafts = proposals(llm)
    assert token_ids(generate(llm, prompts)) == plain_tokens
    assert graph_drafts == plain_drafts
    assert any(max(p) > 1 for p in passes), "no pass over a step's kept positions took the graphs"
    assert any(len(p) > 1 and max(p) == 1 for p in passes), (
        "no chained drafts of several rows took the graphs"
    )
