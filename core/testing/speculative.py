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
