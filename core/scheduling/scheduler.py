"""The Scheduler seam and the default continuous-batching scheduler.

There are no prefill or decode phases: each step, every scheduled request computes its next
``num_new_tokens`` tokens (a prompt chunk, one decode token, or a recompute after preemption) so that
``num_computed_tokens`` catches up with ``num_tokens``. A decoding request with drafts (speculative
decoding) computes its last token plus the drafts, ``1 + len(spec_token_ids)`` tokens, when the budget
and the page pool allow. Policy only: nothing here touches tensors.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass, field

from pegainfer.config.schema import SchedulerConfig
from pegainfer.engine.request import Request, RequestStatus
from pegainfer.memory.buffer_manager import BufferManager

#: The longest prefill chunk of a request that asks for prompt logprobs (its logits are [chunk, vocab]).
PROMPT_LOGPROBS_CHUNK = 256


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step (made for every running request of every step: nothing computed in
    the constructor)."""

    request: Request
    num_new_tokens: int  # the drafts included
    start: int  # position of the first token computed this step: the request's computed tokens
    samples: bool  # the step reaches the request's last known token, so a new token is sampled
    #: Drafts verified this step (positions after the last known token); the last ``len`` of the tokens.
    spec_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def next_tokens(
        cls, request: Request, num_new_tokens: int, spec_token_ids: list[int] | None = None
    ) -> ScheduledRequest:
        """The request's next ``num_new_tokens`` tokens (``spec_token_ids`` the last of them) from its
        computed ones."""
        spec = spec_token_ids or []
        start = request.num_computed_tokens
        samples = start + num_new_tokens - len(spec) == request.num_tokens
        return cls(request, num_new_tokens, start, samples, spec)


@dataclass
class SchedulerOutput:
    """One step's plan, in the order the executor must lay out the batch."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler(ABC):
    """Decides each step which requests compute how many tokens, within the buffer manager's memory."""

    @abstractmethod
    def add_request(self, request: Request) -> None:
        """Queue a new request (status WAITING)."""

    @abstractmethod
    def schedule(self) -> SchedulerOutput:
        """Plan the next step; allocates pages through the buffer manager, preempting when short."""

    @abstractmethod
    def update_after_step(self, output: SchedulerOutput) -> None:
        """Record that the planned tokens were computed (call before appending sampled tokens). Drafts
        are not counted: the engine reports the accepted ones through ``accept_spec_tokens``."""

    @abstractmethod
    def accept_spec_tokens(self, item: ScheduledRequest, num_accepted: int) -> None:
        """Count the first ``num_accepted`` drafts of ``item`` as computed (after their tokens were
        appended). The rejected ones are rolled back: their KV lies beyond ``num_computed_tokens`` and is
        overwritten later; their pages stay allocated."""

    @abstractmethod
    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """End a request (stopped, length, aborted, error) and free its buffers at once."""

    @abstractmethod
    def get_request(self, request_id: str) -> Request | None:
        """The live (unfinished) request with this id."""

    def can_schedule_ahead(self) -> bool:
        """Whether the next ``schedule()`` is sure to neither preempt nor recompute a running request, so it
        may run while the last step's tokens are still pending on the device (their positions and pages
        are known; their values are not). False unless a scheduler knows better."""
        return False

    @property
    @abstractmethod
    def num_running(self) -> int: ...

    @property
    @abstractmethod
    def num_waiting(self) -> int: ...

    def has_unfinished_requests(self) -> bool:
        return self.num_running + self.num_waiting > 0


class ContinuousBatchingScheduler(Scheduler):
    """Running requests first (oldest first), then admissions in arrival order, within a token budget.

    Preemption is by recompute: the most recently admitted running request gives back all its pages and
    goes to the front of the queue with ``num_computed_tokens = 0``; its generated tokens are kept, so it
    later resumes by recomputing prompt + output and continues with the same greedy tokens.
    """

    def __init__(self, config: SchedulerConfig, buffers: BufferManager) -> None:
        self.config = config
        self.buffers = buffers
        # Finished (aborted) waiting requests are dropped lazily when they reach the head, so aborting
        # many waiting requests costs O(1) each rather than a scan of the queue.
        self._waiting: deque[Request] = deque()
        self._num_stale = 0
        self.running: list[Request] = []
        self._requests: dict[str, Request] = {}
        # Without chunked prefill a prompt is admitted whole: no chunk is cut at a snapshot boundary.
        self._cuts_chunks = buffers.cuts_chunks and config.enable_chunked_prefill

    @property
    def waiting(self) -> list[Request]:
        """A snapshot of the live waiting queue, front first (O(n): for inspection, not the hot path)."""
        return [r for r in self._waiting if not r.is_finished]

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting) - self._num_stale

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self._requests[request.request_id] = request
        self._waiting.append(request)

    def _chunk(self, request: Request, budget: int) -> int:
        n = min(request.num_tokens - request.num_computed_tokens, budget)
        # Without chunked prefill a prompt is admitted whole, so the per-chunk threshold does not apply.
        limit = self.config.long_prefill_token_threshold if self.config.enable_chunked_prefill else None
        if (
            request.sampling_params.prompt_logprobs is not None
            and request.num_computed_tokens < request.num_prompt_tokens
            and self.config.enable_chunked_prefill
        ):
            # Prompt logprobs need full-vocabulary logits for every position of the chunk: bound them.
            limit = min(limit or PROMPT_LOGPROBS_CHUNK, PROMPT_LOGPROBS_CHUNK)
        n = min(n, limit) if limit else n
        if self._cuts_chunks and n > 1:
            # Prefix caching of recurrent state: a snapshot boundary inside the chunk ends it there.
            n = self.buffers.chunk_limit(request, n)
        return n

    def _spec_fits(self, request: Request, budget: int) -> list[int]:
        """The drafts of a decoding ``request`` that fit this step: as many as the budget leaves room for,
        all of them with pages, or none (drafts never preempt anyone)."""
        spec = request.spec_token_ids[: budget - 1]
        if request.num_tokens - request.num_computed_tokens != 1 or not spec:
            return []
        if not self.buffers.allocate_slots(request, 1 + len(spec)):
            return []
        return spec

    def _preempt(self, victim: Request, output: SchedulerOutput) -> None:
        self.running.remove(victim)
        victim.status = (
            RequestStatus.PREEMPTED
        )  # before free: the manager keeps a preempted one's pages cached
        self.buffers.free(victim)
        victim.num_computed_tokens = 0
        victim.spec_token_ids = []
        victim.num_preemptions += 1
        self._waiting.appendleft(victim)
        output.preempted.append(victim)

    def schedule(self) -> SchedulerOutput:
        self.buffers.begin_step()
        output = self._schedule()
        if self._cuts_chunks and output.scheduled:
            self.buffers.plan_snapshots(output.scheduled)
        self.buffers.plan_draft_checkpoints(output.scheduled)
        return output

    def _schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        scheduled = output.scheduled
        budget = self.config.max_num_batched_tokens
        running = self.running
        allocate_slots = self.buffers.allocate_slots
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            computed = request.num_computed_tokens
            if (
                len(request.all_token_ids) - computed == 1
                and not request.spec_token_ids
                and allocate_slots(request, 1)
            ):
                # The steady state first: a decoding request computes its one last token and samples the next.
                scheduled.append(ScheduledRequest(request, 1, computed, True))
                budget -= 1
                i += 1
                continue
            if request.spec_token_ids:
                spec = self._spec_fits(request, budget)
                request.spec_token_ids = spec  # drafts that do not fit are dropped: the row decodes normally
                if spec:
                    scheduled.append(ScheduledRequest.next_tokens(request, 1 + len(spec), spec))
                    budget -= 1 + len(spec)
                    i += 1
                    continue
            # A decoding request computes its one last token (what _chunk gives it, whatever the limits).
            n = 1 if len(request.all_token_ids) - computed == 1 else self._chunk(request, budget)
            if n <= 0:
                i += 1
                continue
            while not allocate_slots(request, n):
                victim = running[-1]
                if any(item.request.request_id == victim.request_id for item in scheduled):
                    # Never undo work already planned this step: stop scheduling instead.
                    return output
                self._preempt(victim, output)
                if victim is request:
                    break
            else:
                # A chunk ending at the last known token samples the next one.
                scheduled.append(
                    ScheduledRequest(request, n, computed, computed + n == len(request.all_token_ids))
                )
                budget -= n
                i += 1
                continue
            # ``request`` itself was preempted; the list shifted, so ``i`` already points at the next one.

        while self._waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            if output.preempted:
                break  # memory is short this step: admitting would only thrash
            request = self._waiting[0]
            if request.is_finished:
                self._waiting.popleft()
                self._num_stale -= 1
                continue
            # A cached prefix is skipped: the request is admitted by the pages it needs after it.
            request.num_computed_tokens = self.buffers.find_cached_prefix(request)
            if self.buffers.waits_for_shared_prefix(request):
                # Its next pages are being computed this step by another request: admitted next step, it
                # finds them cached (a burst sharing a system prompt computes the prompt once).
                request.num_computed_tokens = 0
                break
            n = self._chunk(request, budget)
            # Without chunked prefill a prompt is admitted whole; a preempted request's recompute may still
            # be chunked, or one longer than the budget would block the queue forever.
            whole = request.num_tokens - request.num_computed_tokens
            if (
                (not self.config.enable_chunked_prefill and request.num_output_tokens == 0 and n < whole)
                or not self.buffers.can_admit(request, n)
                or not self.buffers.allocate_slots(request, n)
            ):
                request.num_computed_tokens = 0
                break
            self._waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            output.scheduled.append(ScheduledRequest.next_tokens(request, n))
            budget -= n
        return output

    def can_schedule_ahead(self) -> bool:
        # Every running request computes at most its one last token, and the free pages cover a new page
        # for each of them: no allocation can fail, so nobody is preempted (admissions never preempt).
        for request in self.running:
            if len(request.all_token_ids) - request.num_computed_tokens > 1 or request.spec_token_ids:
                return False
        return self.buffers.num_free_pages >= len(self.running)

    def update_after_step(self, output: SchedulerOutput) -> None:
        for item in output.scheduled:
            spec = item.spec_token_ids
            item.request.num_computed_tokens += (
                item.num_new_tokens - len(spec) if spec else item.num_new_tokens
            )

    def accept_spec_tokens(self, item: ScheduledRequest, num_accepted: int) -> None:
        request = item.request
        if not 0 <= num_accepted <= len(item.spec_token_ids):
            raise ValueError(f"{num_accepted} accepted of {len(item.spec_token_ids)} drafts")
        if request.is_finished:
            return
        request.num_computed_tokens = (
            item.start + item.num_new_tokens - len(item.spec_token_ids) + num_accepted
        )

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        if request.is_finished:
            return
        request.status = status
        self.buffers.free(request)
        tracked = self._requests.pop(request.request_id, None) is request
        if request in self.running:
            self.running.remove(request)
        elif tracked:
            self._num_stale += 1  # still in the waiting deque; dropped when it reaches the head
