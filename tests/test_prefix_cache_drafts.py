"""Prefix caching with MTP drafting, simulated: a host-side "device" holds each page slot's main-model token
and each page slot's draft-layer entry (the token there and the token after it, what the MTP layer's KV
depends on). Verification steps write their drafts' KV, the drafter fills its cache after every step and its
chained drafts write past the last computed position. Every read must see its own tokens; nothing may write
into a keyed page."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pegainfer.config.schema import SchedulerConfig
from pegainfer.engine.request import Request, RequestStatus
from pegainfer.scheduling.scheduler import ContinuousBatchingScheduler
from pegainfer.scheduling.speculative import SpeculativeDecoder
from tests.test_prefix_cache import BS, add_random_wave, make_manager, random_bases

NUM_SPEC = 2


def future(request: Request, k: int) -> int:
    return 7 + (request.serial * 5 + k) % 3


def simulate(sched, buffers, rng: random.Random, main: dict, mtp: dict) -> None:

    def slot(store, page):
        return store.setdefault(page, [None] * BS)

    steps = 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        for item in out.scheduled:
            r, rid = item.request, item.request.request_id
            table, ids = buffers.block_table(rid), r.all_token_ids
            for p in range(item.start):
                assert slot(main, table[p // BS])[p % BS] == ids[p], f"{rid} reads another prefix at {p}"
            toks = ids[item.start : item.start + item.num_new_tokens - len(item.spec_token_ids)]
            toks = toks + list(item.spec_token_ids)
            for j, t in enumerate(toks):
                p = item.start + j
                page = table[p // BS]
                assert buffers.pool.hash_of(page) is None, f"{rid} writes into keyed page {page}"
                slot(main, page)[p % BS] = t
        sched.update_after_step(out)
        for item in out.scheduled:
            r = item.request
            if not item.samples or r.is_finished:
                continue
            spec = item.spec_token_ids
            accepted = 0
            while accepted < len(spec) and spec[accepted] == future(r, r.num_output_tokens + accepted):
                accepted += 1
            for _ in range(accepted + 1):
                r.append_output_token(future(r, r.num_output_tokens))
            if spec:
                sched.accept_spec_tokens(item, accepted)
            if r.num_output_tokens >= r.sampling_params.max_tokens:
                sched.finish_request(r, RequestStatus.FINISHED_LENGTH)
        # The drafter, as SpeculativeDecoder.after_step does it.
        for item in out.scheduled:
            r, rid = item.request, item.request.request_id
            r.spec_token_ids = []
            if r.status is not RequestStatus.RUNNING or not SpeculativeDecoder.drafts_for(r):
                continue
            computed = r.num_computed_tokens
            left = r.sampling_params.max_tokens - r.num_output_tokens - 1
            drafts = max(0, min(NUM_SPEC, left)) if item.samples else 0
            table = buffers.block_table(rid)
            if drafts > 1 and not buffers.allocate_slots(r, drafts - 1):
                drafts = min(drafts, len(table) * BS - computed + 1)
            ids = r.all_token_ids
            for p in range(item.start):
                assert slot(mtp, table[p // BS])[p % BS] == (ids[p], ids[p + 1]), (
                    f"{rid}'s drafter reads another prefix at {p}"
                )
            for p in range(item.start, computed):
                slot(mtp, table[p // BS])[p % BS] = (ids[p], ids[p + 1])
            made = []
            for j in range(drafts):
                good = rng.random() < 0.6 and all(
                    m == future(r, r.num_output_tokens + i) for i, m in enumerate(made)
                )
                made.append(future(r, r.num_output_tokens + j) if good else 99)
            for p in range(computed, computed + max(drafts - 1, 0)):  # the chained drafts' cache entries
                page = table[p // BS]
                assert buffers.pool.hash_of(page) is None, f"{rid}'s drafts write into keyed page {page}"
                slot(mtp, page)[p % BS] = ("draft", p)
            r.spec_token_ids = made
        buffers.check_invariants()
        steps += 1
        assert steps < 5000


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    num_blocks=st.integers(8, 20),
    budget=st.integers(4, 40),
    waves=st.integers(1, 3),
)
def test_drafting_simulated_engine_reads_only_its_own_prefix(
    seed: int, num_blocks: int, budget: int, waves: int
) -> None:
    rng = random.Random(seed)
    buffers = make_manager(num_blocks, drafts=SpeculativeDecoder.drafts_for)
    sched = ContinuousBatchingScheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget), buffers
    )
    bases = random_bases(rng)
    main: dict[int, list] = {}
    mtp: dict[int, list] = {}
    for wave in range(waves):
        add_random_wave(sched, rng, bases, wave, num_blocks, headroom=NUM_SPEC, temperature=0.0)
        simulate(sched, buffers, rng, main, mtp)
    assert buffers.pool.num_free == num_blocks and buffers.num_active == 0
