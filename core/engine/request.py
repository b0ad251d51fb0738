"""Request: one sequence being generated, and its state machine.

The scheduler works in token counts only: ``num_computed_tokens`` catches up with ``num_tokens``
(prompt + generated). A prefill chunk, a decode step and a recompute after preemption are the same
thing — computing the next tokens whose KV is not yet cached. With speculative decoding a decoding
request also carries ``spec_token_ids``, drafts for the positions after its last token: a step computes
the last token and the drafts together, and only the accepted drafts count as computed afterwards.
"""

from __future__ import annotations

import enum
import itertools
import sys
import time

import torch

from pegainfer.sampling.sampling_params import RequestOutputKind, SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    # Members are singletons compared by identity: hash them by identity too (C speed) rather than by
    # Enum's Python-level hash of the name, since status checks run for every row of every step.
    __hash__ = object.__hash__

    @property
    def finished(self) -> bool:
        return self in FINISHED_STATUSES


FINISHED_STATUSES = frozenset(s for s in RequestStatus if s.name.startswith("FINISHED"))


_SERIALS = itertools.count()

#: Stands for a token sampled on the device but not read back yet (an overlapped step, see the engine).
PENDING_TOKEN = -1


class Request:
    """A single sequence. ``n > 1`` generations are fanned out into one Request each by the engine."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        arrival_time: float | None = None,
        prompt: str | None = None,
        max_model_len: int | None = None,
        cache_salt: str | None = None,
    ) -> None:
        self.request_id = request_id
        # Unique for the process: a reused request id never aliases an earlier request's device state.
        self.serial = next(_SERIALS)
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING
        # prompt + output in one list, appended in place, so nothing per step is O(length).
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        # The stop conditions in the form the engine checks for every token (prompt + output counts):
        # a request ends by length at ``max_num_tokens`` (max_tokens, or the model's context); before
        # ``min_num_tokens`` no stop condition applies; ``stop_ids`` stop it (its stop_token_ids, and EOS
        # unless ignore_eos).
        limits = [len(self.all_token_ids) + sampling_params.max_tokens] if sampling_params.max_tokens else []
        if max_model_len is not None:
            limits.append(max_model_len)
        self.max_num_tokens = min(limits, default=sys.maxsize)
        self.min_num_tokens = len(self.all_token_ids) + sampling_params.min_tokens
        self.stop_ids = frozenset(sampling_params.stop_token_ids or ()) | frozenset(
            () if sampling_params.ignore_eos else sampling_params.eos_token_ids
        )
        # Whether the engine may report this request before it finishes: not when only the final output
        # of a single sequence is asked for (its user request then neither reports nor ends on its steps).
        self.reports_progress = sampling_params.output_kind is not RequestOutputKind.FINAL_ONLY or (
            sampling_params.n != 1
        )
        # Speculative decoding: draft tokens for the positions after the last one, verified next step
        # (never part of ``all_token_ids``), and this request's draft/accept counts for its metrics.
        self.spec_token_ids: list[int] = []
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        self.first_token_time: float | None = None
        # The seeded request's own random stream, created by the sampler on first use.
        self.generator: torch.Generator | None = None
        # The sampler's running token counts for penalties (created on first use).
        self.penalty_state: object | None = None
        # The structured output's matcher (``pegainfer.sampling.structured``), set by the engine.
        self.grammar: object | None = None
        #: (token, matcher): a grammar that becomes ``grammar`` once that token is appended.
        self.deferred_grammar: tuple[int, object] | None = None
        # Prefix caching: what else keys this request's pages (requests with different salts share none),
        # the keys of its full pages computed so far (the buffer manager's, once per page), and how many
        # prompt tokens its first admission found cached.
        self.cache_salt = cache_salt
        self.page_hashes: list[bytes] = []
        self.num_cached_tokens = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids) :]

    @property
    def is_finished(self) -> bool:
        return self.status in FINISHED_STATUSES

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    def append_output_token(self, token_id: int) -> None:
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        self.all_token_ids.append(token_id)

    def append_pending_token(self) -> None:
        """Count a token that was sampled on the device and is not known on the host yet: the next step
        can be scheduled (its position, its page) before the token is read back."""
        self.all_token_ids.append(PENDING_TOKEN)

    def resolve_pending_token(self, token_id: int) -> None:
        """Replace the last token, a pending one, by its value."""
        if self.all_token_ids[-1] != PENDING_TOKEN:
            raise RuntimeError(f"{self.request_id}: the last token is not pending")
        self.all_token_ids[-1] = token_id
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
