"""SamplingParams: what a user asks of one generation, validated once at construction."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace

from pegainfer.errors import RequestError
from pegainfer.sampling.structured import StructuredOutputsParams


class RequestOutputKind(enum.Enum):
    """What ``LLMEngine.step`` reports for a request: everything so far each step, only what is new
    (streaming), or only the final result (offline batch runs; keeps per-step work O(1) per request)."""

    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final_only"


@dataclass
class SamplingParams:
    """Per-request sampling settings, shaped like vLLM's so scripts carry over.

    ``temperature == 0`` means greedy. ``top_k <= 0`` (or -1) and ``top_p == 1`` disable those filters.
    ``logprobs=k`` returns, for every generated token, the k most likely tokens plus the chosen one;
    ``prompt_logprobs=k`` does the same for prompt positions (the first has none).
    ``logit_bias`` (OpenAI's): token id -> a value in [-100, 100] added to that token's logit before any
    penalty, filter or draw (logprobs still describe the model). ``allowed_token_ids`` (vLLM's): only
    these tokens may be drawn (a classifier's labels, say). ``structured_outputs``: a grammar the answer
    must follow (``pegainfer.sampling.structured``).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Filled by the engine from the tokenizer / generation_config, not by users.
    eos_token_ids: tuple[int, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        self.logit_bias = dict(self.logit_bias) if self.logit_bias else None
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        self._validate()

    def _validate(self) -> None:
        def bad(param: str, why: str) -> RequestError:
            return RequestError(f"{param} {why}, got {getattr(self, param)!r}", param=param)

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", "must be in [0, 100]")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", "must be -1 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise bad("repetition_penalty", "must be in (0, 10]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise bad(name, "must be in [-2, 2]")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", "must be a positive integer")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "must be a non-negative integer")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must not exceed max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= 20):
                raise bad(name, "must be an integer in [0, 20]")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "must be an integer")
        if any(not s for s in self.stop):
            raise RequestError("stop strings must not be empty", param="stop")
        if self.allowed_token_ids is not None and (
            not self.allowed_token_ids
            or any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.allowed_token_ids)
        ):
            raise bad("allowed_token_ids", "must be a non-empty list of token ids")
        if self.allowed_token_ids is not None and self.structured_outputs is not None:
            raise RequestError(
                "allowed_token_ids and structured_outputs cannot both limit the tokens",
                param="allowed_token_ids",
            )
        for token, value in (self.logit_bias or {}).items():
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise RequestError(f"logit_bias keys must be token ids, got {token!r}", param="logit_bias")
            if isinstance(value, bool) or not isinstance(value, int | float) or not -100.0 <= value <= 100.0:
                raise RequestError(
                    f"logit_bias values must be in [-100, 100], got {value!r} for token {token}",
                    param="logit_bias",
                )

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def clone(self, **changes: object) -> SamplingParams:
        return replace(self, **changes)
