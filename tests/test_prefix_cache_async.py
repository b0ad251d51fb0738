"""Prefix caching under async scheduling (a step planned while the last one's tokens are still pending on
the device) and aborts: a simulated engine like test_prefix_cache's, whose device knows each pending token
before the host does. Every chunk must read the KV and state of exactly its own (final) tokens."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pegainfer.config.schema import SchedulerConfig
from pegainfer.engine.request import PENDING_TOKEN, Request, RequestStatus
from pegainfer.scheduling.scheduler import ContinuousBatchingScheduler, SchedulerOutput
from tests.test_prefix_cache import add_random_wave, make_manager, random_bases, save_checkpoints


def future(request: Request, k: int) -> int:
    """The ``k``-th output token ``request`` samples (the device knows it before the host)."""
    return 7 + (request.serial + k) % 3


def real_ids(request: Request) -> list[int]:
    ids = list(request.all_token_ids)
    if ids and ids[-1] == PENDING_TOKEN:
        ids[-1] = future(request, request.num_output_tokens - 1)
    return ids


class AsyncDevice:
    def __init__(self, buffers) -> None:
        self.buffers = buffers
        self.kv: dict[int, list[int | None]] = {}
        self.state: dict[int, tuple[int, ...]] = {}
        self.snaps: dict[int, tuple[int, ...]] = {}

    def run(self, out: SchedulerOutput) -> None:
        buffers, bs = self.buffers, self.buffers.block_size
        restores, saves, checkpoints = buffers.take_state_copies()
        for slot, snap in restores:
            self.state[slot] = self.snaps[snap]
        for item in out.scheduled:
            request, rid = item.request, item.request.request_id
            table, slot = buffers.block_table(rid), buffers.state_slot(rid)
            ids = real_ids(request)
            for p in range(item.start):
                assert self.kv[table[p // bs]][p % bs] == ids[p], f"{rid} reads another prefix at {p}"
            if slot is not None:
                if item.start == 0:
                    self.state[slot] = ()
                assert self.state[slot] == tuple(ids[: item.start]), f"{rid} resumes from another state"
            end = item.start + item.num_new_tokens
            for p in range(item.start, end):
                page = table[p // bs]
                assert buffers.pool.hash_of(page) is None, f"{rid} writes into keyed page {page}"
                self.kv.setdefault(page, [None] * bs)[p % bs] = ids[p]
            if slot is not None:
                save_checkpoints(self.snaps, checkpoints, slot, ids, item, rid)
                self.state[slot] = tuple(ids[:end])
        for slot, snap in saves:
            self.snaps[snap] = self.state[slot]


def run_async(sched, buffers, device, rng: random.Random, abort_rate: float) -> None:
    pending: list[Request] = []

    def resolve() -> None:
        nonlocal pending
        for request in pending:
            if request.is_finished:
                continue
            request.resolve_pending_token(future(request, request.num_output_tokens - 1))
            if request.num_output_tokens >= request.sampling_params.max_tokens:
                sched.finish_request(request, RequestStatus.FINISHED_LENGTH)
        pending = []

    steps = 0
    while sched.has_unfinished_requests() or pending:
        if pending and (
            not sched.can_schedule_ahead()
            or any(len(r.all_token_ids) >= r.max_num_tokens and not r.is_finished for r in pending)
        ):
            resolve()
        for request in list(sched.running):
            if rng.random() < abort_rate:
                sched.finish_request(request, RequestStatus.FINISHED_ABORTED)
        out = sched.schedule()
        if not out.scheduled:
            resolve()
            buffers.check_invariants()
            steps += 1
            assert steps < 5000
            continue
        device.run(out)
        sched.update_after_step(out)
        resolve()
        for item in out.scheduled:
            if item.samples and not item.request.is_finished:
                item.request.append_pending_token()
                pending.append(item.request)
        buffers.check_invariants()
        steps += 1
        assert steps < 5000


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    hybrid=st.booleans(),
    num_blocks=st.integers(6, 20),
    budget=st.integers(4, 40),
    waves=st.integers(1, 3),
    abort_rate=st.sampled_from([0.0, 0.05, 0.2]),
    inside=st.sampled_from([0, 6, 40]),
)
def test_async_simulated_engine_reads_only_its_own_prefix(
    seed: int, hybrid: bool, num_blocks: int, budget: int, waves: int, abort_rate: float, inside: int
) -> None:
    rng = random.Random(seed)
    buffers = make_manager(
        num_blocks,
        state_slots=4 if hybrid else 0,
        snapshots=3 if hybrid else 0,
        snapshot_inside_chunk_tokens=inside,
    )
    sched = ContinuousBatchingScheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget), buffers
    )
    bases = random_bases(rng)
    device = AsyncDevice(buffers)
    for wave in range(waves):
        add_random_wave(sched, rng, bases, wave, num_blocks)
        run_async(sched, buffers, device, rng, abort_rate)
    assert buffers.pool.num_free == num_blocks and buffers.num_active == 0
    buffers.snapshots.check()
