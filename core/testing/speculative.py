"""Drafts forced right or wrong, whatever the MTP module proposes (tests and benchmarks).

A plugin's tests check that greedy output with drafts equals the output without them. With random MTP
weights every draft is rejected, so the roll-back paths a partly accepted verification takes are only
reached by replacing the drafts: ``force_drafts`` keeps the engine's real ``propose`` (it fills the MTP
cache) and swaps the tokens it returns for the target's own continuation, all or only the first few.
A benchmark uses the same to time drafting at a known acceptance on random weights.
"""

from __future__ import annotations

from typing import Any


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
