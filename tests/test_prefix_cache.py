"""Prefix caching's bookkeeping: the page cache (keys, refcounts, LRU eviction), the scheduler admitting by
the pages a request needs after its hit, state snapshots for models with recurrent state, and a simulated
engine (a host-side "KV" written through the block tables) that checks every chunk reads the KV of its own
tokens, hit or not, and that no page is written once it is keyed."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pegainfer.config.schema import CacheConfig, SchedulerConfig, validate_section
from pegainfer.engine.request import PENDING_TOKEN, Request, RequestStatus
from pegainfer.errors import ConfigError
from pegainfer.executor.model_batch import ModelBatch, SequenceChunk
from pegainfer.executor.step_message import StepDecoder, StepEncoder
from pegainfer.memory.buffer_manager import BlockPool, PagedBufferManager
from pegainfer.memory.buffer_specs import PagedKVSpec, RecurrentStateSpec
from pegainfer.memory.device_buffers import DeviceBuffers
from pegainfer.memory.memory_plan import MemoryPlan, plan_memory
from pegainfer.memory.prefix_cache import SnapshotPool, page_hashes
from pegainfer.sampling.sampling_params import SamplingParams
from pegainfer.scheduling.scheduler import ContinuousBatchingScheduler, SchedulerOutput

BS = 4


def make_manager(
    num_blocks: int = 32, *, state_slots: int = 0, snapshots: int = 0, interval: int = 2, **kwargs
) -> PagedBufferManager:
    plan = MemoryPlan(
        budget=0,
        weight_bytes=0,
        block_size=BS,
        num_blocks=num_blocks,
        page_bytes=1,
        num_state_slots=state_slots,
        state_bytes_per_slot=1 if state_slots else 0,
        num_snapshot_slots=snapshots,
    )
    return PagedBufferManager(plan, prefix_caching=True, snapshot_interval_pages=interval, **kwargs)


def make_request(rid: str, tokens: list[int], max_tokens: int = 4, **kwargs) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens, **kwargs))


def admit(buffers: PagedBufferManager, request: Request, n: int | None = None) -> int:
    """Admit like the scheduler: skip the cached prefix, then allocate the rest (or ``n`` tokens)."""
    request.num_computed_tokens = buffers.find_cached_prefix(request)
    cached = request.num_computed_tokens
    n = request.num_tokens - cached if n is None else n
    assert buffers.can_admit(request, n) and buffers.allocate_slots(request, n)
    return cached


def compute(request: Request, n: int | None = None) -> None:
    request.num_computed_tokens += request.num_tokens - request.num_computed_tokens if n is None else n


# -------------------------------------------------------------------------------------------- BlockPool


def test_pool_keeps_released_pages_cached_and_evicts_least_recently_released() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(2), pool.allocate(2)
    assert pool.register(a[0], b"a0") and pool.register(a[1], b"a1") and pool.register(b[0], b"b0")
    assert not pool.register(b[1], b"a0"), "a key held by another page stays with it"
    pool.free(a)
    pool.free(b)
    assert pool.num_free == 4 and pool.num_cached == 3 and pool.lookup(b"a1") == a[1]
    # The uncached page goes first; then a's pages, its last page before the first one it chains from.
    assert pool.allocate(1) == [b[1]]
    assert pool.allocate(1) == [a[1]] and pool.lookup(b"a1") is None and pool.num_evictions == 1
    pool.hold([a[0]])
    assert pool.num_free == 1 and pool.allocate(1) == [b[0]] and pool.allocate(1) is None
    pool.check({a[0]: 1, a[1]: 1, b[0]: 1, b[1]: 1})


def test_keys_chain_and_depend_on_salt_and_lookahead() -> None:
    tokens = list(range(12))
    plain = page_hashes(make_request("a", tokens), 3, BS)
    assert len(set(plain)) == 3
    other = make_request("b", [*tokens[:4], 99, *tokens[5:]])
    assert page_hashes(other, 3, BS)[0] == plain[0] and page_hashes(other, 3, BS)[1:] != plain[1:]
    salted = make_request("c", tokens)
    salted.cache_salt = "tenant"
    assert page_hashes(salted, 1, BS)[0] != plain[0]
    assert page_hashes(make_request("d", tokens), 1, BS, lookahead=1, salt=b"mtp")[0] != plain[0]


# ------------------------------------------------------------------------------------ page cache hits


def test_repeated_prompt_hits_all_pages_but_the_last_token() -> None:
    buffers = make_manager()
    tokens = list(range(13))
    first = make_request("a", tokens)
    assert admit(buffers, first) == 0
    compute(first)
    buffers.free(first)
    again = make_request("b", tokens)
    assert admit(buffers, again) == 12
    assert buffers.block_table("b")[:3] == buffers.pool.free_ids()[:0] + buffers.block_table("b")[:3]
    # A prompt of whole pages recomputes its last page: its last token's logits are needed.
    exact = make_request("c", tokens[:12])
    assert admit(buffers, exact) == 8
    buffers.check_invariants()
    assert buffers.prefix_cache_stats == (13 + 13 + 12, 12 + 8)
    assert again.num_cached_tokens == 12


def test_shared_pages_survive_preemption_and_abort_of_a_sharer() -> None:
    buffers = make_manager(num_blocks=8)
    tokens = list(range(9))
    owner = make_request("a", tokens)
    admit(buffers, owner)
    compute(owner)
    buffers.allocate_slots(owner, 1)  # the next step keys the computed pages
    sharers = [make_request(f"s{i}", tokens[:8] + [50 + i]) for i in range(2)]
    for s in sharers:
        assert admit(buffers, s) == 8
    shared = buffers.block_table("a")[:2]
    assert all(buffers.block_table(s.request_id)[:2] == shared for s in sharers)
    buffers.check_invariants()
    sharers[0].status = RequestStatus.PREEMPTED
    buffers.free(sharers[0])
    owner.status = RequestStatus.FINISHED_ABORTED
    buffers.free(owner)
    assert buffers.block_table("s1")[:2] == shared and buffers.pool._refs[shared[0]] == 1
    buffers.check_invariants()
    buffers.free(sharers[1])
    assert buffers.pool.num_free == 8 and buffers.usage() == 0.0
    buffers.check_invariants()


def test_pages_with_a_pending_token_are_not_keyed() -> None:
    buffers = make_manager()
    request = make_request("a", list(range(7)))
    admit(buffers, request)
    compute(request)
    request.append_pending_token()  # position 7: the page [4, 8) is computed once 7 is, but 7 is unknown
    assert buffers.allocate_slots(request, 1)
    compute(request, 1)
    assert buffers.allocate_slots(request, 1) or True
    assert buffers.pool.num_cached == 1
    request.resolve_pending_token(42)
    request.append_pending_token()
    buffers.allocate_slots(request, 1)
    assert buffers.pool.num_cached == 2
    buffers.check_invariants()


def test_prompt_logprobs_requests_never_hit() -> None:
    buffers = make_manager()
    tokens = list(range(9))
    first = make_request("a", tokens)
    admit(buffers, first)
    compute(first)
    buffers.free(first)
    assert buffers.find_cached_prefix(make_request("b", tokens, prompt_logprobs=1)) == 0
    assert buffers.find_cached_prefix(make_request("c", tokens)) == 8


def test_scheduler_admits_by_the_pages_needed_after_the_hit() -> None:
    """A request whose prefix is held by a running request is admitted into a pool that could not hold
    its prompt uncached: it takes the shared pages and only needs one of its own."""
    buffers = make_manager(num_blocks=6)
    sched = ContinuousBatchingScheduler(SchedulerConfig(), buffers)
    tokens = list(range(16))
    first = make_request("a", tokens, max_tokens=10)
    sched.add_request(first)
    for _ in range(2):  # the prompt, then one decode step (which keys the prompt's pages): 5 pages held
        out = sched.schedule()
        sched.update_after_step(out)
        first.append_output_token(7)
    second = make_request("b", [*tokens, 3], max_tokens=2)
    assert buffers.pool.num_free == 1 and not buffers.can_admit(second, second.num_tokens)
    sched.add_request(second)
    out = sched.schedule()
    assert [item.request.request_id for item in out.scheduled] == ["a", "b"]
    assert out.scheduled[1].start == 16 and second.num_cached_tokens == 16
    assert buffers.block_table("b")[:4] == buffers.block_table("a")[:4]
    buffers.check_invariants()


def test_a_burst_sharing_a_prefix_computes_it_once() -> None:
    """Requests arriving together with the same 3-page prefix: the first is scheduled alone while the
    others wait a step (their next page is being computed), then they hit all of it; a request whose pages
    are nobody else's is admitted the same step."""
    buffers = make_manager(num_blocks=32)
    sched = ContinuousBatchingScheduler(SchedulerConfig(), buffers)
    shared = list(range(12))
    burst = [make_request(rid, [*shared, 20 + i, 30 + i], max_tokens=3) for i, rid in enumerate("abc")]
    for request in burst:
        sched.add_request(request)
    out = sched.schedule()
    assert [item.request.request_id for item in out.scheduled] == ["a"]
    sched.update_after_step(out)
    burst[0].append_output_token(5)
    sched.add_request(make_request("d", list(range(50, 64))))
    out = sched.schedule()
    assert [item.request.request_id for item in out.scheduled] == ["a", "b", "c", "d"]
    assert [item.start for item in out.scheduled[1:]] == [12, 12, 0]
    assert burst[1].num_cached_tokens == burst[2].num_cached_tokens == 12
    buffers.check_invariants()


def test_a_request_waits_only_for_pages_computed_this_step() -> None:
    """The page a waiting request would wait for is in flight only while the step computing it runs: a
    request whose sharer left before its step ran (here: aborted) is admitted at once."""
    buffers = make_manager(num_blocks=32)
    sched = ContinuousBatchingScheduler(SchedulerConfig(), buffers)
    first = make_request("a", list(range(12)) + [40, 41])
    sched.add_request(first)
    sched.schedule()
    second = make_request("b", list(range(12)) + [42, 43])
    assert buffers.waits_for_shared_prefix(second)  # a's pages are being computed in the open step
    sched.finish_request(first, RequestStatus.FINISHED_ABORTED)  # before its step's pages were computed
    sched.add_request(second)
    out = sched.schedule()
    assert [item.request.request_id for item in out.scheduled] == ["b"] and out.scheduled[0].start == 0
    buffers.check_invariants()


def test_hit_is_taken_before_new_pages_evict_it() -> None:
    """The new pages of an admission never evict the cached pages it takes."""
    buffers = make_manager(num_blocks=4)
    first = make_request("a", list(range(12)))
    admit(buffers, first)
    compute(first)
    buffers.free(first)  # 3 cached pages, all evictable, 1 never used
    second = make_request("b", list(range(12)) + [7, 7, 7, 7])
    assert admit(buffers, second) == 12
    assert len(set(buffers.block_table("b"))) == 4
    buffers.check_invariants()


# ------------------------------------------------------------------------------------------ snapshots


def test_chunks_are_cut_at_snapshot_boundaries() -> None:
    buffers = make_manager(state_slots=2, snapshots=4, interval=2)
    request = make_request("a", list(range(23)))  # snapshots at 8, 16 and the prompt's 20
    assert buffers.cuts_chunks
    assert buffers.chunk_limit(request, 23) == 8
    request.num_computed_tokens = 8
    assert buffers.chunk_limit(request, 15) == 8
    request.num_computed_tokens = 16
    assert buffers.chunk_limit(request, 7) == 4
    request.num_computed_tokens = 20
    assert buffers.chunk_limit(request, 3) == 3


def test_snapshots_are_saved_published_and_restored() -> None:
    buffers = make_manager(state_slots=2, snapshots=4, interval=2)
    sched = ContinuousBatchingScheduler(SchedulerConfig(), buffers)
    tokens = list(range(18))
    first = make_request("a", tokens, max_tokens=1)
    sched.add_request(first)
    copies = run_engine(sched, buffers)
    saves = [save for _, steps in copies for save in steps]
    assert len(saves) == 2, "snapshots at 8 and 16 (the prompt's last page boundary and the interval)"
    second = make_request("b", tokens[:17] + [5, 5, 5], max_tokens=1)
    sched.add_request(second)
    out = sched.schedule()
    restores, _, _ = buffers.take_state_copies()
    assert out.scheduled[0].start == 16 and restores == [(buffers.state_slot("b"), saves[1][1])]
    buffers.check_invariants()


def test_a_short_chunk_keeps_a_boundary_inside_and_the_forward_snapshots_it() -> None:
    """With ``snapshot_inside_chunk_tokens`` a chunk crossing the prompt's last page boundary is not cut
    there: one step, whose forward saves the state at that boundary (a checkpoint, not a save after it),
    and a repeat of the prompt resumes from it. A second boundary inside the same chunk still cuts it."""
    buffers = make_manager(state_slots=2, snapshots=4, interval=2, snapshot_inside_chunk_tokens=12)
    sched = ContinuousBatchingScheduler(SchedulerConfig(), buffers)
    tokens = list(range(10))  # the prompt's last page boundary short of its last token: 8
    sched.add_request(make_request("a", tokens, max_tokens=1))
    out = sched.schedule()
    assert [(i.start, i.num_new_tokens) for i in out.scheduled] == [(0, 10)], "one chunk, not 8 + 2"
    _, saves, checkpoints = buffers.take_state_copies()
    assert saves == [] and checkpoints == [(buffers.state_slot("a"), checkpoints[0][1], 8, 1)]
    sched.update_after_step(out)
    out.scheduled[0].request.append_output_token(7)
    sched.finish_request(out.scheduled[0].request, RequestStatus.FINISHED_LENGTH)
    sched.add_request(make_request("b", tokens, max_tokens=1))
    out = sched.schedule()
    restores, _, _ = buffers.take_state_copies()
    assert out.scheduled[0].start == 8 and restores == [(buffers.state_slot("b"), checkpoints[0][1])]
    # 8 and 12 are boundaries of a 14-token prompt (the interval, and its last page boundary): the first
    # stays inside a chunk of 14, the second cuts it.
    wide = make_manager(state_slots=2, snapshots=4, interval=2, snapshot_inside_chunk_tokens=16)
    assert wide.chunk_limit(make_request("c", list(range(50, 64))), 14) == 12


def test_a_shared_prefix_gets_a_snapshot_where_the_cached_pages_end() -> None:
    """A request whose cached pages go past the last snapshot resumes from the snapshot, its chunk is cut
    where the cached pages end and snapshotted there: the next request sharing that prefix hits it all."""
    buffers = make_manager(state_slots=2, snapshots=4, interval=2)
    sched = ContinuousBatchingScheduler(SchedulerConfig(), buffers)
    device = FakeDevice(buffers)
    base = list(range(23))
    sched.add_request(make_request("a", base, max_tokens=1))
    run_engine(sched, buffers, device)
    second = make_request("b", base[:13] + [90, 91, 92], max_tokens=1)
    sched.add_request(second)
    steps = run_engine(sched, buffers, device)
    assert second.num_cached_tokens == 8 and steps[0][0].scheduled[0].num_new_tokens == 4
    third = make_request("c", base[:13] + [80, 81], max_tokens=1)
    sched.add_request(third)
    run_engine(sched, buffers, device)
    assert third.num_cached_tokens == 12
    buffers.check_invariants()


def test_a_snapshot_goes_with_its_page() -> None:
    buffers = make_manager(num_blocks=5, state_slots=1, snapshots=2, interval=2)
    sched = ContinuousBatchingScheduler(SchedulerConfig(), buffers)
    sched.add_request(make_request("a", list(range(9)), max_tokens=1))
    run_engine(sched, buffers)
    assert buffers.snapshots.num_published == 1
    sched.add_request(make_request("b", [100 + i for i in range(17)], max_tokens=1))
    run_engine(sched, buffers)  # needs every page: a's are evicted, and with them a's snapshot
    assert buffers.find_cached_prefix(make_request("c", list(range(9)))) == 0
    buffers.check_invariants()


def test_snapshot_pool_evicts_least_recently_used() -> None:
    pool = SnapshotPool(2)
    a, b = pool.take(), pool.take()
    pool.pend(a, make_request("a", [1] * 4), 1, step=1)
    pool.pend(b, make_request("b", [2] * 4), 1, step=1)
    keys = {a: b"ka", b: b"kb"}
    pool.publish(1, lambda r, n: None)  # written by this step: not yet
    assert pool.num_published == 0
    pool.publish(2, lambda r, n: keys[a] if r.request_id == "a" else keys[b])
    assert pool.find(b"ka") == a  # touched: b is now the least recently used
    assert pool.take() == b and pool.find(b"kb") is None
    pool.pend(b, make_request("c", [3] * 4), 1, step=2)
    pool.check()


# ------------------------------------------------------------------------------------- the plumbing


def test_state_copies_travel_in_every_step_message() -> None:
    enc, dec = StepEncoder(), StepDecoder()
    chunk = SequenceChunk("a", [1], 4, [0, 1], 0, num_logits=1, serial=3)
    batch = ModelBatch([chunk], state_restores=[(0, 2)], state_saves=[(0, 1)])
    got = dec.batch(enc.batch(batch))
    assert (got.state_restores, got.state_saves) == ([(0, 2)], [(0, 1)])
    batch.moved_on, batch.state_restores, batch.state_saves = True, [], [(0, 3)]
    got = dec.batch(enc.batch(batch))
    assert got.moved_on and (got.state_restores, got.state_saves) == ([], [(0, 3)])


def test_device_snapshots_round_trip() -> None:
    spec = RecurrentStateSpec(0, (("conv", (2, 3)), ("ssm", (2,))), torch.float32)
    kv = PagedKVSpec(1, 1, 2, torch.float32)
    plan = MemoryPlan(0, 0, num_state_slots=2, state_bytes_per_slot=1, num_blocks=2, page_bytes=1)
    plan = MemoryPlan(**{**plan.__dict__, "num_snapshot_slots": 3})
    buffers = DeviceBuffers([spec, kv], plan, torch.device("cpu"))
    buffers.states[0]["conv"][1] = 7.0
    buffers.copy_snapshots([(1, 2)], save=True)
    assert buffers.snapshots[0]["conv"][2].eq(7.0).all() and buffers.snapshots[0]["ssm"][2].eq(0).all()
    buffers.copy_snapshots([(0, 2)], save=False)
    assert buffers.states[0]["conv"][0].eq(7.0).all()


def test_memory_plan_sizes_snapshots() -> None:
    state = RecurrentStateSpec(0, (("s", (256,)),), torch.float32)  # 1 KiB a slot
    kv = PagedKVSpec(1, 1, 8, torch.float32)
    common = dict(
        budget=1 << 20,
        weight_bytes=0,
        specs=[state, kv],
        transients=[],
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=64,
    )
    assert plan_memory(**common).num_snapshot_slots == 0
    auto = plan_memory(**common, prefix_caching=True)
    assert auto.num_snapshot_slots == 4 and "state snapshots 4" in auto.describe()
    assert auto.cache_bytes == auto.kv_bytes + auto.state_bytes + 4 * 1024
    assert plan_memory(**common, prefix_caching=True, num_state_snapshots=9).num_snapshot_slots == 9
    assert plan_memory(**{**common, "specs": [kv]}, prefix_caching=True).num_snapshot_slots == 0
    capped = plan_memory(**common, prefix_caching=True)
    uncapped = plan_memory(**common, prefix_caching=True, cap_pages=False)
    assert capped.num_blocks == 4 * 16 < uncapped.num_blocks


def test_automatic_snapshot_count_never_fails_a_plan_that_fits_without_caching() -> None:
    """Prefix caching is on by default: its automatic snapshot count ("at most a tenth of what the slots
    leave") must not turn a plan that fits into a ConfigError. Here a tenth is less than one snapshot, and
    one snapshot leaves too little for the pages of one request: no snapshot (caching runs off) instead."""
    state = RecurrentStateSpec(0, (("s", (256 * 64,)),), torch.float32)  # 64 KiB a slot
    kv = PagedKVSpec(1, 1, 8, torch.float32)  # 512 B a 4-token page
    common = dict(
        budget=4 * 65536 + 16 * 512 + 20000,  # the 4 slots, one 64-token request's 16 pages and a little
        weight_bytes=0,
        specs=[state, kv],
        transients=[],
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=64,
    )
    off = plan_memory(**common)
    on = plan_memory(**common, prefix_caching=True)
    assert on.num_snapshot_slots == 0 and on.num_blocks == off.num_blocks
    # Where one snapshot fits beside one request's pages, there is one (as before).
    roomy = plan_memory(**{**common, "budget": common["budget"] + 65536}, prefix_caching=True)
    assert roomy.num_snapshot_slots == 1 and roomy.num_blocks >= 16


def test_cache_config_validation() -> None:
    assert CacheConfig().enable_prefix_caching is True
    with pytest.raises(ConfigError, match="enable_prefix_caching"):
        validate_section(CacheConfig, {"enable_prefix_caching": "maybe"}, "cache")
    with pytest.raises(ConfigError, match="num_state_snapshots is set but enable_prefix_caching is false"):
        validate_section(CacheConfig, {"enable_prefix_caching": False, "num_state_snapshots": 4}, "cache")
    with pytest.raises(ConfigError, match="snapshot_interval_pages"):
        validate_section(CacheConfig, {"snapshot_interval_pages": 0}, "cache")


# ---------------------------------------------------------------------------- the simulated engine


def random_bases(rng: random.Random) -> list[list[int]]:
    """Two random prompts of 4-19 tokens over 3 ids: the prefixes a simulated workload shares."""
    return [[rng.randrange(3) for _ in range(rng.randrange(4, 20))] for _ in range(2)]


def add_random_wave(
    sched: ContinuousBatchingScheduler,
    rng: random.Random,
    bases: list[list[int]],
    wave: int,
    num_blocks: int,
    headroom: int = 0,
    **params,
) -> None:
    """Up to 6 requests: a random prefix of one of ``bases`` plus a tail of up to 2 tokens, 1-13 tokens
    out; a request that could not fit the pool (with ``headroom`` more positions, e.g. drafts) is left out."""
    for i in range(rng.randrange(1, 7)):
        base = rng.choice(bases)
        prompt = base[: rng.randrange(1, len(base) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(3))]
        max_tokens = rng.randrange(1, 14)
        if len(prompt) + max_tokens + headroom > (num_blocks - 1) * BS:
            continue
        sched.add_request(make_request(f"{wave}-{i}", prompt, max_tokens, **params))


def save_checkpoints(
    snaps: dict[int, tuple[int, ...]], checkpoints: list, slot: int, ids: list[int], item, rid: str
) -> None:
    """A fake device's forward saving ``slot``'s checkpoints inside ``item``'s chunk: the tokens up to each."""
    for state, snap, tokens, count in checkpoints:
        if state == slot:
            assert 0 < tokens and tokens + count - 1 < item.num_new_tokens, (
                f"{rid}: a checkpoint outside its chunk"
            )
            for j in range(count):
                snaps[snap + j] = tuple(ids[: item.start + tokens + j])


class FakeDevice:
    """What the device would hold, written through the block tables: each page slot's token, each state
    slot's tokens so far (a recurrent state is a function of them), each snapshot's."""

    def __init__(self, buffers: PagedBufferManager) -> None:
        self.buffers = buffers
        self.kv: dict[int, list[int | None]] = {}
        self.state: dict[int, tuple[int, ...]] = {}
        self.snaps: dict[int, tuple[int, ...]] = {}

    def run(self, out: SchedulerOutput) -> list[tuple[int, int]]:
        buffers, bs = self.buffers, self.buffers.block_size
        restores, saves, checkpoints = buffers.take_state_copies()
        for slot, snap in restores:
            self.state[slot] = self.snaps[snap]
        for item in out.scheduled:
            request, rid = item.request, item.request.request_id
            table, slot = buffers.block_table(rid), buffers.state_slot(rid)
            ids = request.all_token_ids
            for p in range(item.start):  # the context this chunk attends to is its own tokens
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
        return saves


def run_engine(
    sched: ContinuousBatchingScheduler, buffers: PagedBufferManager, device: FakeDevice | None = None
):
    """Drain the scheduler like the engine does; (plan, saves) per step."""
    device = device or FakeDevice(buffers)
    steps = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        steps.append((out, device.run(out)))
        sched.update_after_step(out)
        for item in out.scheduled:
            if item.samples:
                request = item.request
                request.append_output_token(7 + request.num_output_tokens % 3)
                if request.num_output_tokens >= request.sampling_params.max_tokens:
                    sched.finish_request(request, RequestStatus.FINISHED_LENGTH)
        buffers.check_invariants()
        assert len(steps) < 5000
    return steps


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    hybrid=st.booleans(),
    num_blocks=st.integers(6, 20),
    budget=st.integers(4, 40),
    waves=st.integers(1, 3),
    inside=st.sampled_from([0, 6, 40]),
)
def test_simulated_engine_reads_only_its_own_prefix(
    seed: int, hybrid: bool, num_blocks: int, budget: int, waves: int, inside: int
) -> None:
    """Random prompts sharing random prefixes arrive in waves into a small pool (evictions, preemptions):
    every chunk reads the KV and state of exactly its own tokens, no keyed page is written, every page
    comes back (the events show hits, evictions and preemptions happen). ``inside``: chunks up to that
    long keep a snapshot boundary inside (a checkpoint the forward saves)."""
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
    device = FakeDevice(buffers)
    for wave in range(waves):
        add_random_wave(sched, rng, bases, wave, num_blocks)
        for out, _ in run_engine(sched, buffers, device):
            event("preempted" if out.preempted else "no preemption")
    event("hit" if buffers.prefix_cache_stats[1] else "no hit")
    event("evicted" if buffers.pool.num_evictions else "nothing evicted")
    assert buffers.pool.num_free == num_blocks and buffers.num_active == 0
    assert PENDING_TOKEN not in [t for page in device.kv.values() for t in page]
