"""ContinuousBatchingScheduler: token budget, max_num_seqs, chunking, preemption by recompute, abort.

The engine loop is simulated here with a real PagedBufferManager (bookkeeping only, no device tensors):
``schedule -> update_after_step -> append a token for every sampling row -> finish at max_tokens``.
"""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pegainfer.config.schema import SchedulerConfig
from pegainfer.engine.request import Request, RequestStatus
from pegainfer.memory.buffer_manager import PagedBufferManager
from pegainfer.memory.memory_plan import MemoryPlan
from pegainfer.sampling.sampling_params import SamplingParams
from pegainfer.scheduling.scheduler import ContinuousBatchingScheduler, SchedulerOutput


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def make_scheduler(
    num_blocks: int = 256, block_size: int = 4, **config: object
) -> tuple[ContinuousBatchingScheduler, PagedBufferManager]:
    plan = MemoryPlan(budget=0, weight_bytes=0, block_size=block_size, num_blocks=num_blocks, page_bytes=1)
    buffers = PagedBufferManager(plan)
    return ContinuousBatchingScheduler(SchedulerConfig(**config), buffers), buffers


def make_request(rid: object, prompt_len: int, max_tokens: int = 4) -> Request:
    return Request(str(rid), list(range(prompt_len)), SamplingParams(max_tokens=max_tokens))


def output_token(request: Request) -> int:
    """A deterministic 'sampled' token: the n-th output of every request is 1000 + n."""
    return 1000 + request.num_output_tokens


def step(sched: ContinuousBatchingScheduler) -> SchedulerOutput:
    """One engine step: plan, record, sample, finish requests that reached max_tokens."""
    out = sched.schedule()
    sched.update_after_step(out)
    for item in out.scheduled:
        if item.samples:
            req = item.request
            req.append_output_token(output_token(req))
            if req.num_output_tokens >= req.sampling_params.max_tokens:
                sched.finish_request(req, RequestStatus.FINISHED_LENGTH)
    return out


def drain(sched: ContinuousBatchingScheduler, max_steps: int = 10_000) -> list[SchedulerOutput]:
    outs = []
    while sched.has_unfinished_requests():
        assert len(outs) < max_steps, f"no progress after {max_steps} steps: {sched.running} {sched.waiting}"
        outs.append(step(sched))
    return outs


def pages(buffers: PagedBufferManager, req: Request) -> int:
    return len(buffers.block_table(req.request_id))


# ----------------------------------------------------------------------------------------- budgets


def test_token_budget_never_exceeded_and_every_row_progresses() -> None:
    """Each step's scheduled tokens fit max_num_batched_tokens, and no row is scheduled for 0 tokens."""
    sched, buffers = make_scheduler(max_num_batched_tokens=16, max_num_seqs=8)
    reqs = [make_request(i, prompt_len=3 + 7 * i % 29, max_tokens=1 + i % 6) for i in range(20)]
    for r in reqs:
        sched.add_request(r)
    outs = drain(sched)
    assert all(0 < o.num_batched_tokens <= 16 for o in outs)
    assert all(item.num_new_tokens >= 1 for o in outs for item in o.scheduled)
    # The budget is actually used: while prompts are waiting, steps are full.
    assert outs[0].num_batched_tokens == 16
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in reqs)
    assert buffers.pool.num_free == buffers.pool.num_blocks


def test_max_num_seqs_respected() -> None:
    """Never more than max_num_seqs running (or scheduled) requests; the rest wait their turn."""
    sched, _ = make_scheduler(max_num_batched_tokens=1000, max_num_seqs=3)
    for i in range(10):
        sched.add_request(make_request(i, prompt_len=5, max_tokens=3))
    out = step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["0", "1", "2"]
    assert sched.num_running == 3 and sched.num_waiting == 7
    while sched.has_unfinished_requests():
        out = step(sched)
        assert sched.num_running <= 3
        assert len(out.scheduled) <= 3


def test_admission_in_arrival_order() -> None:
    """Waiting requests are admitted first come, first served."""
    sched, _ = make_scheduler(max_num_batched_tokens=1000, max_num_seqs=2)
    for i in range(6):
        sched.add_request(make_request(i, prompt_len=2, max_tokens=1))
    admitted = [item.request.request_id for o in drain(sched) for item in o.scheduled]
    assert admitted == [str(i) for i in range(6)]


# ---------------------------------------------------------------------------------------- chunking


def test_long_prompt_chunked_across_steps_by_token_budget() -> None:
    """A prompt longer than the budget is computed in consecutive chunks; only the last chunk samples."""
    sched, buffers = make_scheduler(max_num_batched_tokens=16)
    req = make_request("long", prompt_len=50, max_tokens=3)
    sched.add_request(req)
    outs = drain(sched)
    plan = [(o.scheduled[0].start, o.scheduled[0].num_new_tokens, o.scheduled[0].samples) for o in outs]
    assert plan == [
        (0, 16, False),
        (16, 16, False),
        (32, 16, False),
        (48, 2, True),
        (50, 1, True),
        (51, 1, True),
    ]
    assert req.output_token_ids == [1000, 1001, 1002]


def test_long_prefill_token_threshold_caps_each_chunk() -> None:
    """long_prefill_token_threshold caps one request's chunk even when the budget has room for more."""
    sched, _ = make_scheduler(max_num_batched_tokens=100, long_prefill_token_threshold=8)
    a, b = make_request("a", 20, max_tokens=2), make_request("b", 5, max_tokens=2)
    sched.add_request(a)
    sched.add_request(b)
    out = step(sched)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 8), ("b", 5)]
    out = step(sched)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 8), ("b", 1)]
    out = step(sched)
    assert [(s.request.request_id, s.num_new_tokens, s.samples) for s in out.scheduled] == [("a", 4, True)]


def test_running_requests_served_before_admissions() -> None:
    """Running requests (oldest first) take the budget before any waiting request is admitted."""
    sched, _ = make_scheduler(max_num_batched_tokens=8)
    a = make_request("a", 3, max_tokens=10)
    sched.add_request(a)
    step(sched)  # a: prefill
    b = make_request("b", 30, max_tokens=2)
    sched.add_request(b)
    out = step(sched)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 7)]
    c = make_request("c", 4, max_tokens=2)
    sched.add_request(c)
    out = step(sched)
    # a decodes, b (running, mid-prefill) takes the rest of the budget: c is not admitted.
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 7)]
    assert c.status is RequestStatus.WAITING and c.num_computed_tokens == 0


def test_decode_rows_get_exactly_one_token() -> None:
    """Once its prompt is computed, a request is scheduled for exactly one token per step."""
    sched, _ = make_scheduler(max_num_batched_tokens=64, max_num_seqs=4)
    for i in range(8):
        sched.add_request(make_request(i, prompt_len=10 + i, max_tokens=5))
    decodes = 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        for item in out.scheduled:
            if item.start >= item.request.num_prompt_tokens:
                assert item.num_new_tokens == 1 and item.samples
                decodes += 1
        sched.update_after_step(out)
        for item in out.scheduled:
            if item.samples:
                item.request.append_output_token(0)
                if item.request.num_output_tokens >= 5:
                    sched.finish_request(item.request, RequestStatus.FINISHED_LENGTH)
    assert decodes == 8 * 4


def test_chunked_prefill_disabled_admits_whole_prompts_only() -> None:
    """With enable_chunked_prefill=False a prompt is admitted whole, or waits for a step with room."""
    sched, _ = make_scheduler(max_num_batched_tokens=10, enable_chunked_prefill=False)
    a, b = make_request("a", 6, max_tokens=3), make_request("b", 6, max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    out = step(sched)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 6)]
    out = step(sched)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 6)]
    drain(sched)
    assert a.num_output_tokens == b.num_output_tokens == 3


def test_chunked_prefill_disabled_preempted_request_is_readmitted() -> None:
    """A request whose prompt fits the budget must still complete after a preemption (no livelock)."""
    # Pool of 4 pages x 4 tokens; each request alone needs at most 1 + 9 - 1 = 9 KV slots (3 pages), and
    # its 1-token prompt fits the budget of 8. Request 1 is preempted holding 9 tokens > 8: never readmitted.
    sched, _ = make_scheduler(num_blocks=4, max_num_batched_tokens=8, enable_chunked_prefill=False)
    reqs = [make_request(i, prompt_len=1, max_tokens=9) for i in range(2)]
    for r in reqs:
        sched.add_request(r)
    drain(sched, max_steps=200)
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in reqs)


# -------------------------------------------------------------------------------------- preemption


def test_preemption_recomputes_most_recent_request() -> None:
    """When pages run out the most recently admitted request gives back everything and is recomputed."""
    # 6 pages of 4 tokens; three requests of 4 + 8 tokens need 3 pages each at their longest (9 > 6).
    sched, buffers = make_scheduler(num_blocks=6, max_num_batched_tokens=100, max_num_seqs=3)
    a, b, c = (make_request(x, prompt_len=4, max_tokens=8) for x in "abc")
    d = make_request("d", prompt_len=2, max_tokens=1)
    for r in (a, b, c, d):
        sched.add_request(r)
    preempted: list[SchedulerOutput] = []
    while not preempted:
        out = step(sched)
        if out.preempted:
            preempted.append(out)
    out = preempted[0]
    # a is the oldest: it needs its third page at position 8, the victim is c, the newest.
    assert out.preempted == [c]
    assert [s.request for s in out.scheduled] == [a, b]
    assert c.status is RequestStatus.PREEMPTED
    assert c.num_computed_tokens == 0 and c.num_preemptions == 1
    assert pages(buffers, c) == 0
    assert sched.waiting[0] is c and sched.waiting[1] is d  # front of the queue, ahead of d
    assert c not in sched.running
    kept = c.output_token_ids
    assert kept == [1000 + i for i in range(5)]  # sampled at positions 4..8, all kept
    buffers.check_invariants()

    outs = drain(sched)
    # c comes back by recomputing prompt + output, then continues where it stopped.
    resumed = next(item for o in outs for item in o.scheduled if item.request is c)
    assert resumed.start == 0 and resumed.num_new_tokens == c.num_prompt_tokens + len(kept)
    for r in (a, b, c, d):
        assert r.status is RequestStatus.FINISHED_LENGTH
    assert c.output_token_ids == [1000 + i for i in range(8)]
    assert a.num_preemptions == 0
    assert buffers.pool.num_free == 6


def test_preemption_victims_go_back_in_admission_order() -> None:
    """Several victims in one step: newest first out of running, the older one ends at the queue front."""
    # 4 pages of 2 tokens. a prefills in chunks of 4 tokens (2 pages); b and c hold one page each.
    sched, buffers = make_scheduler(
        num_blocks=4, block_size=2, max_num_batched_tokens=100, long_prefill_token_threshold=4
    )
    a = make_request("a", prompt_len=8, max_tokens=1)
    b, c = make_request("b", prompt_len=1, max_tokens=5), make_request("c", prompt_len=1, max_tokens=5)
    for r in (a, b, c):
        sched.add_request(r)
    out = step(sched)
    assert [(s.request, s.num_new_tokens) for s in out.scheduled] == [(a, 4), (b, 1), (c, 1)]
    assert buffers.pool.num_free == 0
    out = step(sched)  # a's next chunk needs 2 pages: c goes, still short, then b goes
    assert out.preempted == [c, b]
    assert [(s.request, s.start, s.num_new_tokens) for s in out.scheduled] == [(a, 4, 4)]
    assert list(sched.waiting) == [b, c]
    assert b.output_token_ids == [1000] and c.output_token_ids == [1000]
    buffers.check_invariants()
    drain(sched)
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in (a, b, c))
    assert b.output_token_ids == c.output_token_ids == [1000, 1001, 1002, 1003, 1004]


def test_no_admission_in_a_step_that_preempted() -> None:
    """A step that had to preempt admits nobody: admitting would only thrash."""
    sched, buffers = make_scheduler(num_blocks=2, block_size=2, max_num_batched_tokens=100)
    a, b = make_request("a", 2, max_tokens=3), make_request("b", 1, max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)  # a: 1 page, b: 1 page
    late = make_request("late", 1, max_tokens=1)
    sched.add_request(late)
    out = step(sched)  # a needs a second page -> b is preempted
    assert out.preempted == [b]
    assert all(s.request is not late for s in out.scheduled)
    assert list(sched.waiting) == [b, late]
    drain(sched)
    assert all(r.is_finished for r in (a, b, late))
    assert buffers.pool.num_free == 2


# ------------------------------------------------------------------------------------------- abort


def test_abort_waiting_request() -> None:
    """Aborting a waiting request removes it from the queue; it is never scheduled."""
    sched, buffers = make_scheduler(max_num_seqs=1)
    a, b = make_request("a", 4), make_request("b", 4)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    sched.finish_request(b, RequestStatus.FINISHED_ABORTED)
    assert b.status is RequestStatus.FINISHED_ABORTED and b.finish_reason == "abort"
    assert sched.num_waiting == 0 and sched.get_request("b") is None
    outs = drain(sched)
    assert all(item.request is a for o in outs for item in o.scheduled)
    assert buffers.pool.num_free == buffers.pool.num_blocks


def test_abort_running_request_frees_pages_at_once() -> None:
    """Aborting a running request returns all its pages immediately, and it leaves the running list."""
    sched, buffers = make_scheduler(num_blocks=16)
    a, b = make_request("a", 10, max_tokens=50), make_request("b", 6, max_tokens=50)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    step(sched)
    assert pages(buffers, a) == 3 and pages(buffers, b) == 2
    free_before = buffers.pool.num_free
    sched.finish_request(a, RequestStatus.FINISHED_ABORTED)
    assert buffers.pool.num_free == free_before + 3
    assert pages(buffers, a) == 0 and a not in sched.running and sched.get_request("a") is None
    buffers.check_invariants()
    # Aborting twice, or finishing after an abort, changes nothing.
    sched.finish_request(a, RequestStatus.FINISHED_LENGTH)
    assert a.status is RequestStatus.FINISHED_ABORTED
    out = step(sched)
    assert [s.request for s in out.scheduled] == [b]


def test_abort_preempted_request() -> None:
    """A preempted request (back in the queue, no pages) can be aborted too."""
    sched, buffers = make_scheduler(num_blocks=2, block_size=2, max_num_batched_tokens=100)
    a, b = make_request("a", 2, max_tokens=3), make_request("b", 1, max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    out = step(sched)
    assert out.preempted == [b]
    sched.finish_request(b, RequestStatus.FINISHED_ABORTED)
    assert sched.num_waiting == 0 and b.is_finished
    drain(sched)
    assert a.status is RequestStatus.FINISHED_LENGTH
    assert buffers.pool.num_free == 2


# ------------------------------------------------------------------------------ liveness and speed


@pytest.mark.parametrize(
    ("num_blocks", "block_size", "budget", "max_seqs", "threshold"),
    [(4, 4, 8, 8, None), (3, 2, 3, 4, None), (8, 1, 5, 3, 2), (5, 4, 64, 16, None), (2, 8, 1, 2, None)],
)
def test_every_request_finishes_when_each_fits_alone(
    num_blocks: int, block_size: int, budget: int, max_seqs: int, threshold: int | None
) -> None:
    """No livelock: heavy page pressure still completes every request that alone fits the pool."""
    sched, buffers = make_scheduler(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_batched_tokens=budget,
        max_num_seqs=max_seqs,
        long_prefill_token_threshold=threshold,
    )
    capacity = num_blocks * block_size
    reqs = []
    for i in range(30):
        prompt = 1 + (i * 7) % capacity
        max_tokens = 1 + (i * 5) % (capacity - prompt + 1)
        reqs.append(make_request(i, prompt, max_tokens))
        sched.add_request(reqs[-1])
    drain(sched, max_steps=20_000)
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in reqs)
    assert all(r.output_token_ids == [1000 + i for i in range(r.sampling_params.max_tokens)] for r in reqs)
    assert buffers.pool.num_free == num_blocks
    buffers.check_invariants()


def test_scheduling_many_requests_is_not_quadratic() -> None:
    """2000 short requests with max_num_seqs=256 run to completion quickly (no O(waiting) per step)."""
    sched, buffers = make_scheduler(
        num_blocks=4096, block_size=16, max_num_batched_tokens=8192, max_num_seqs=256
    )
    reqs = [make_request(i, prompt_len=8, max_tokens=4) for i in range(2000)]
    t0 = time.perf_counter()
    for r in reqs:
        sched.add_request(r)
    outs = drain(sched)
    elapsed = time.perf_counter() - t0
    assert all(r.is_finished for r in reqs)
    assert max(len(o.scheduled) for o in outs) == 256
    assert buffers.pool.num_free == 4096
    assert elapsed < 2.0, f"took {elapsed:.2f}s"


# -------------------------------------------------------------------------------- property test


@st.composite
def scenarios(draw: st.DrawFn) -> dict:
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    num_blocks = draw(st.integers(1, 12))
    capacity = block_size * num_blocks
    ops = []
    for _ in range(draw(st.integers(1, 40))):
        kind = draw(st.sampled_from(["add", "add", "step", "step", "step", "abort"]))
        if kind == "add":
            prompt = draw(st.integers(1, capacity))
            # The longest KV a request needs is prompt + max_tokens - 1 (the last token is never computed).
            ops.append(("add", prompt, draw(st.integers(1, capacity - prompt + 1))))
        elif kind == "abort":
            ops.append(("abort", draw(st.integers(0, 1000))))
        else:
            ops.append(("step",))
    return {
        "block_size": block_size,
        "num_blocks": num_blocks,
        "max_num_batched_tokens": draw(st.integers(1, 24)),
        "max_num_seqs": draw(st.integers(1, 6)),
        "long_prefill_token_threshold": draw(st.one_of(st.none(), st.integers(1, 10))),
        "ops": ops,
    }


def check_state(sched: ContinuousBatchingScheduler, buffers: PagedBufferManager) -> None:
    buffers.check_invariants()
    bs = buffers.block_size
    assert sched.num_running <= sched.config.max_num_seqs
    for r in sched.running:
        assert r.status is RequestStatus.RUNNING
        assert pages(buffers, r) == cdiv(r.num_computed_tokens, bs)
    for r in sched.waiting:
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert r.num_computed_tokens == 0 and pages(buffers, r) == 0
    assert {r.request_id for r in [*sched.running, *sched.waiting]} == set(sched._requests)


def checked_step(sched: ContinuousBatchingScheduler, buffers: PagedBufferManager) -> SchedulerOutput:
    out = sched.schedule()
    cfg, bs = sched.config, buffers.block_size
    assert out.num_batched_tokens <= cfg.max_num_batched_tokens
    ids = [s.request.request_id for s in out.scheduled]
    assert len(ids) == len(set(ids))
    for item in out.scheduled:
        req = item.request
        assert item.num_new_tokens >= 1 and req in sched.running
        assert item.start == req.num_computed_tokens
        assert item.start + item.num_new_tokens <= req.num_tokens
        if cfg.long_prefill_token_threshold:
            assert item.num_new_tokens <= cfg.long_prefill_token_threshold
        # Pages for this step's tokens are in place before the forward pass.
        assert pages(buffers, req) == cdiv(item.start + item.num_new_tokens, bs)
    for victim in out.preempted:
        assert victim not in sched.running and pages(buffers, victim) == 0
    assert list(sched.waiting)[: len(out.preempted)] == list(reversed(out.preempted))
    buffers.check_invariants()
    if out.preempted:
        event("preempted")
    sched.update_after_step(out)
    for item in out.scheduled:
        if item.samples:
            req = item.request
            req.append_output_token(output_token(req))
            if req.num_output_tokens >= req.sampling_params.max_tokens:
                sched.finish_request(req, RequestStatus.FINISHED_LENGTH)
    return out


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_random_add_step_abort_keeps_invariants_and_drains(scenario: dict) -> None:
    """Any add/step/abort sequence keeps pages consistent, and draining finishes every request."""
    sched, buffers = make_scheduler(
        num_blocks=scenario["num_blocks"],
        block_size=scenario["block_size"],
        max_num_batched_tokens=scenario["max_num_batched_tokens"],
        max_num_seqs=scenario["max_num_seqs"],
        long_prefill_token_threshold=scenario["long_prefill_token_threshold"],
    )
    reqs: list[Request] = []
    for op in scenario["ops"]:
        if op[0] == "add":
            reqs.append(make_request(len(reqs), op[1], op[2]))
            sched.add_request(reqs[-1])
        elif op[0] == "step":
            checked_step(sched, buffers)
        else:
            live = [r for r in reqs if not r.is_finished]
            if live:
                victim = live[op[1] % len(live)]
                sched.finish_request(victim, RequestStatus.FINISHED_ABORTED)
                assert pages(buffers, victim) == 0 and sched.get_request(victim.request_id) is None
        check_state(sched, buffers)
    steps = 0
    while sched.has_unfinished_requests():
        steps += 1
        assert steps < 5_000, "livelock: requests that each fit the pool never finish"
        checked_step(sched, buffers)
        check_state(sched, buffers)
    assert buffers.pool.num_free == buffers.pool.num_blocks
    assert not buffers._tables
    for r in reqs:
        assert r.is_finished
        if r.status is RequestStatus.FINISHED_LENGTH:
            assert r.output_token_ids == [1000 + i for i in range(r.sampling_params.max_tokens)]


def test_aborting_many_waiting_requests_is_not_quadratic() -> None:
    """Aborts of waiting requests (newest first, the worst order for a scan) cost O(1) each."""
    import time

    sched, buffers = make_scheduler(num_blocks=64, max_num_batched_tokens=8)
    reqs = [make_request(i, prompt_len=4, max_tokens=2) for i in range(20000)]
    for r in reqs:
        sched.add_request(r)
    start = time.perf_counter()
    for r in reversed(reqs[1:]):
        sched.finish_request(r, RequestStatus.FINISHED_ABORTED)
    assert time.perf_counter() - start < 1.0
    assert sched.num_waiting == 1 and sched.waiting == [reqs[0]]
    out = sched.schedule()
    assert [s.request for s in out.scheduled] == [reqs[0]]
    buffers.check_invariants()
