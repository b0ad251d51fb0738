"""Engine-side state of a user request: its ``n`` sequences, their detokenizers and logprobs, and the
RequestOutput built from them."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pegainfer.engine.outputs import CompletionOutput, PositionLogprobs, RequestMetrics, RequestOutput
from pegainfer.engine.request import FINISHED_STATUSES, Request
from pegainfer.sampling.sampling_params import RequestOutputKind, SamplingParams
from pegainfer.text.detokenizer import IncrementalDetokenizer


@dataclass(slots=True)
class SequenceState:
    """Engine-side state of one generated sequence (one of a parent's ``n``)."""

    request: Request
    index: int
    detokenizer: IncrementalDetokenizer
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    num_reported: int = 0  # output tokens already sent in DELTA mode


@dataclass
class RequestGroup:
    """A user request: its ``n`` sequences and the prompt logprobs they share."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    sequences: list[SequenceState] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] | None = None

    @property
    def finished(self) -> bool:
        for seq in self.sequences:  # a plain loop: this runs for every row of every step
            if seq.request.status not in FINISHED_STATUSES:
                return False
        return True

    def to_output(self) -> RequestOutput:
        """This request's RequestOutput in its ``output_kind`` (DELTA: only what is new since the last call)."""
        delta = self.params.output_kind is RequestOutputKind.DELTA
        outputs = []
        for seq in self.sequences:
            req = seq.request
            if delta:
                # Only what is new since the last report: streaming stays O(1) per token.
                start, seq.num_reported = seq.num_reported, req.num_output_tokens
                token_ids = req.all_token_ids[req.num_prompt_tokens + start :]
                text = seq.detokenizer.get_delta(req.is_finished)
                logprobs = None if seq.logprobs is None else seq.logprobs[start:]
            else:
                detok = seq.detokenizer
                # Until the request ends, the held-back tail may still be cut by a stop string.
                text = detok.output_text if req.is_finished else detok.stable_text
                token_ids, logprobs = req.output_token_ids, seq.logprobs
            outputs.append(
                CompletionOutput(
                    index=seq.index,
                    text=text,
                    token_ids=token_ids,
                    cumulative_logprob=seq.cumulative_logprob,
                    logprobs=logprobs,
                    finish_reason=req.finish_reason,
                    stop_reason=req.stop_reason,
                )
            )
        first = [s.request.first_token_time for s in self.sequences if s.request.first_token_time]
        metrics = RequestMetrics(
            arrival_time=self.arrival_time,
            first_token_time=min(first) if first else None,
            finished_time=time.monotonic() if self.finished else None,
            num_preemptions=sum(s.request.num_preemptions for s in self.sequences),
            spec_draft_tokens=sum(s.request.num_draft_tokens for s in self.sequences),
            spec_accepted_tokens=sum(s.request.num_accepted_tokens for s in self.sequences),
        )
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=self.finished,
            prompt_logprobs=self.prompt_logprobs,
            metrics=metrics,
            # The prompt tokens the first sequence found cached when it was first admitted (vLLM's field).
            num_cached_tokens=self.sequences[0].request.num_cached_tokens,
        )
