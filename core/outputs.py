"""What generation returns, shaped like vLLM's RequestOutput so user code carries over."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """The log-probability of one token under the model's raw distribution, and its rank there (1 = best)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per position: token id -> Logprob. The chosen token is always present.
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    metrics: RequestMetrics | None = field(default=None, repr=False)
