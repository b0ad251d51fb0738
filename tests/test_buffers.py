"""BlockPool and PagedBufferManager: page bookkeeping, append-only block tables, state slots, invariants."""

from __future__ import annotations

import pytest
import torch

from pegainfer.engine.request import Request
from pegainfer.memory.buffer_manager import BlockPool, PagedBufferManager
from pegainfer.memory.buffer_specs import PagedKVSpec, PagedLatentSpec, RecurrentStateSpec
from pegainfer.memory.device_buffers import DeviceBuffers
from pegainfer.memory.memory_plan import MemoryPlan, plan_memory
from pegainfer.sampling.sampling_params import SamplingParams

KV = PagedKVSpec(layer_index=0, num_kv_heads=2, head_dim=3, dtype=torch.float32)
LATENT = PagedLatentSpec(layer_index=1, latent_dim=4, rope_dim=2, dtype=torch.float32)
STATE = RecurrentStateSpec(layer_index=2, shapes=(("conv", (2, 3)), ("ssm", (2, 2))), dtype=torch.float32)


def make_plan(num_blocks: int = 8, block_size: int = 4, num_state_slots: int = 0) -> MemoryPlan:
    return MemoryPlan(
        budget=0,
        weight_bytes=0,
        block_size=block_size,
        num_blocks=num_blocks,
        page_bytes=1,
        num_state_slots=num_state_slots,
        state_bytes_per_slot=1 if num_state_slots else 0,
    )


def make_manager(num_blocks: int = 8, block_size: int = 4, num_state_slots: int = 0) -> PagedBufferManager:
    return PagedBufferManager(make_plan(num_blocks, block_size, num_state_slots))


def make_request(rid: str, prompt_len: int = 4) -> Request:
    return Request(rid, list(range(prompt_len)), SamplingParams(max_tokens=4))


# ---------------------------------------------------------------------------------------- BlockPool


def test_block_pool_allocate_free_and_short() -> None:
    """Pages are handed out once each; a short pool returns None and changes nothing."""
    pool = BlockPool(5)
    a = pool.allocate(3)
    assert a is not None and len(set(a)) == 3 and pool.num_free == 2
    assert pool.allocate(3) is None and pool.num_free == 2
    assert pool.allocate(0) == []
    b = pool.allocate(2)
    assert b is not None and set(a) | set(b) == set(range(5)) and pool.num_free == 0
    assert pool.allocate(1) is None
    pool.free(a)
    assert pool.num_free == 3 and sorted(pool.free_ids()) == sorted(a)
    assert sorted(pool.allocate(3) or []) == sorted(a)


def test_block_pool_reuses_freshly_freed_pages_first() -> None:
    """Recently freed pages are the next ones handed out (they are warm in cache)."""
    pool = BlockPool(8)
    first = pool.allocate(4)
    assert first == [0, 1, 2, 3]
    pool.free([2])
    assert pool.allocate(1) == [2]


def test_block_pool_empty() -> None:
    """A pool of zero pages can only hand out zero pages."""
    pool = BlockPool(0)
    assert pool.num_free == 0 and pool.allocate(0) == [] and pool.allocate(1) is None


# ---------------------------------------------------------------------------------- paged tables


def test_allocate_slots_grows_table_append_only() -> None:
    """A block table only grows: earlier pages keep their place while the request holds them."""
    mgr = make_manager(num_blocks=8, block_size=4)
    req = make_request("r")
    assert mgr.allocate_slots(req, 5)
    table = list(mgr.block_table("r"))
    assert len(table) == 2
    req.num_computed_tokens = 5
    assert mgr.allocate_slots(req, 3)  # positions 5..7: still inside page 2
    assert mgr.block_table("r") == table
    req.num_computed_tokens = 8
    assert mgr.allocate_slots(req, 1)  # position 8: a third page
    grown = list(mgr.block_table("r"))
    assert len(grown) == 3 and grown[:2] == table
    req.num_computed_tokens = 9
    assert mgr.allocate_slots(req, 10)  # positions 9..18: pages 4 and 5
    assert len(mgr.block_table("r")) == 5 and mgr.block_table("r")[:3] == grown
    assert mgr.usage() == pytest.approx(5 / 8)
    mgr.check_invariants()


def test_allocate_slots_takes_pages_exactly_when_the_held_ones_are_full() -> None:
    """One token at a time, a page is taken exactly at each page boundary; a freed (preempted) request
    starts again from no pages and no slot."""
    mgr = make_manager(num_blocks=8, block_size=4, num_state_slots=2)
    req = make_request("r")
    for computed in range(12):
        req.num_computed_tokens = computed
        free = mgr.pool.num_free
        assert mgr.allocate_slots(req, 1)
        assert free - mgr.pool.num_free == (computed % 4 == 0)
        assert mgr.state_slot("r") is not None
        mgr.check_invariants()
    assert len(mgr.block_table("r")) == 3
    mgr.free(req)
    req.num_computed_tokens = 0
    assert mgr.block_table("r") == [] and mgr.state_slot("r") is None
    assert mgr.allocate_slots(req, 1)
    assert len(mgr.block_table("r")) == 1 and mgr.state_slot("r") is not None
    mgr.check_invariants()


def test_allocate_slots_short_changes_nothing() -> None:
    """When pages are short allocate_slots returns False and takes nothing."""
    mgr = make_manager(num_blocks=3, block_size=4)
    a, b = make_request("a"), make_request("b")
    assert mgr.allocate_slots(a, 8)
    assert not mgr.allocate_slots(b, 5)
    assert mgr.pool.num_free == 1 and mgr.block_table("b") == []
    a.num_computed_tokens = 8
    assert not mgr.allocate_slots(a, 9)  # needs 3 more pages, 1 free
    assert len(mgr.block_table("a")) == 2 and mgr.pool.num_free == 1
    mgr.check_invariants()


def test_distinct_requests_get_distinct_pages() -> None:
    """No page is shared between requests."""
    mgr = make_manager(num_blocks=10, block_size=2)
    reqs = [make_request(str(i)) for i in range(5)]
    for r in reqs:
        assert mgr.allocate_slots(r, 4)
    owned = [p for r in reqs for p in mgr.block_table(r.request_id)]
    assert sorted(owned) == list(range(10))
    assert mgr.usage() == 1.0 and mgr.num_active == 5
    mgr.check_invariants()


def test_free_returns_everything_and_is_idempotent() -> None:
    """free gives back every page at once; a second free (or freeing an unknown request) is a no-op."""
    mgr = make_manager(num_blocks=6, block_size=4)
    a, b = make_request("a"), make_request("b")
    mgr.allocate_slots(a, 9)
    mgr.allocate_slots(b, 4)
    mgr.free(a)
    assert mgr.pool.num_free == 5 and mgr.block_table("a") == []
    mgr.free(a)
    mgr.free(make_request("never-seen"))
    assert mgr.pool.num_free == 5 and mgr.block_table("b") != []
    mgr.check_invariants()
    mgr.free(b)
    assert mgr.pool.num_free == 6 and mgr.usage() == 0.0 and mgr.num_active == 0
    mgr.check_invariants()


def test_can_admit_checks_pages_without_allocating() -> None:
    """can_admit answers from the free count and leaves the pool untouched."""
    mgr = make_manager(num_blocks=3, block_size=4)
    req = make_request("r")
    assert mgr.can_admit(req, 12)
    assert not mgr.can_admit(req, 13)
    assert mgr.pool.num_free == 3 and mgr.block_table("r") == []
    assert mgr.state_slot("r") is None  # no recurrent state in this model


# ------------------------------------------------------------------------------------ state slots


def test_state_slot_per_request() -> None:
    """One slot per request, the same on every call, until it is freed; a freed slot is taken again."""
    mgr = make_manager(num_blocks=8, block_size=4, num_state_slots=2)
    a, b, c = make_request("a"), make_request("b"), make_request("c")
    assert mgr.allocate_slots(a, 4)
    sa = mgr.state_slot("a")
    assert sa is not None
    a.num_computed_tokens = 4
    assert mgr.allocate_slots(a, 1)
    assert mgr.state_slot("a") == sa
    assert mgr.allocate_slots(b, 4)
    assert mgr.state_slot("b") == 1 - sa

    # Slots exhausted: c cannot be admitted although pages are free, and a failed try takes nothing.
    assert mgr.pool.num_free > 0
    assert not mgr.can_admit(c, 1)
    free_pages = mgr.pool.num_free
    assert not mgr.allocate_slots(c, 1)
    assert mgr.pool.num_free == free_pages and mgr.state_slot("c") is None and mgr.block_table("c") == []
    mgr.check_invariants()

    # Freeing a returns its slot; c takes it.
    mgr.free(a)
    assert mgr.state_slot("a") is None
    assert mgr.can_admit(c, 1) and mgr.allocate_slots(c, 1)
    assert mgr.state_slot("c") == sa
    mgr.check_invariants()


def test_device_buffers_follow_the_plan_and_zero_only_the_slots_asked() -> None:
    """Page pools and state pools at the plan's sizes; ``zero_slots`` clears the given slots and no other."""
    buffers = DeviceBuffers([KV, LATENT, STATE], make_plan(8, 4, 3), torch.device("cpu"))
    assert buffers.caches[0].shape == KV.page_shape(8, 4)
    assert buffers.caches[1].shape == LATENT.page_shape(8, 4)
    assert buffers.states[2]["conv"].shape == (3, 2, 3) and buffers.states[2]["ssm"].shape == (3, 2, 2)
    for t in buffers.states[2].values():
        t.fill_(7.0)
    buffers.zero_slots([0, 2])
    for t in buffers.states[2].values():
        assert torch.all(t[0] == 0) and torch.all(t[2] == 0) and torch.all(t[1] == 7)
    buffers.zero_slots([])  # nothing to do


def test_state_slot_not_taken_when_pages_short() -> None:
    """A request refused for lack of pages does not keep a state slot."""
    mgr = make_manager(num_blocks=1, block_size=4, num_state_slots=2)
    a, b = make_request("a"), make_request("b")
    assert mgr.allocate_slots(a, 4)
    assert not mgr.allocate_slots(b, 1)
    assert mgr.state_slot("b") is None and len(mgr._free_slots) == 1
    mgr.check_invariants()


def test_state_only_model_needs_no_pages() -> None:
    """A model with recurrent state only (no paged layer) is admitted on state slots alone."""
    plan = plan_memory(
        budget=1 << 20,
        weight_bytes=0,
        specs=[STATE],
        transients=[],
        block_size=4,
        max_num_seqs=1,
        max_num_batched_tokens=64,
        max_model_len=64,
    )
    assert plan.num_blocks == 0 and plan.num_state_slots == 1
    mgr = PagedBufferManager(plan)
    a, b = make_request("a"), make_request("b")
    assert mgr.can_admit(a, 4) and mgr.allocate_slots(a, 4)
    assert mgr.block_table("a") == [] and mgr.state_slot("a") == 0
    assert not mgr.can_admit(b, 1)
    mgr.free(a)
    assert mgr.can_admit(b, 1)
    mgr.check_invariants()


# ------------------------------------------------------------------------------------- invariants


def _busy_manager() -> PagedBufferManager:
    mgr = make_manager(num_blocks=6, block_size=4, num_state_slots=3)
    mgr.allocate_slots(make_request("a"), 8)
    mgr.allocate_slots(make_request("b"), 4)
    mgr.check_invariants()
    return mgr


def test_check_invariants_catches_page_owned_twice() -> None:
    """Two requests holding the same page is caught."""
    mgr = _busy_manager()
    mgr._tables["b"].append(mgr._tables["a"][0])
    mgr.pool._free.pop()  # keep the total count right, so only the double ownership is wrong
    with pytest.raises(AssertionError, match="owned by two"):
        mgr.check_invariants()


def test_check_invariants_catches_page_owned_and_free() -> None:
    """A page that is both owned and on the free list is caught."""
    mgr = _busy_manager()
    mgr.pool._free.append(mgr._tables["a"][0])
    with pytest.raises(AssertionError):
        mgr.check_invariants()


def test_check_invariants_catches_lost_page() -> None:
    """A page that is neither owned nor free is caught."""
    mgr = _busy_manager()
    mgr.pool._free.pop()
    with pytest.raises(AssertionError, match="lost"):
        mgr.check_invariants()


def test_check_invariants_catches_state_slot_corruption() -> None:
    """A slot owned twice, or a slot lost, is caught."""
    mgr = _busy_manager()
    mgr._slots["b"] = mgr._slots["a"]
    with pytest.raises(AssertionError):
        mgr.check_invariants()
    mgr = _busy_manager()
    mgr._free_slots.pop()
    with pytest.raises(AssertionError, match="lost"):
        mgr.check_invariants()


@pytest.mark.parametrize("corrupt", ["duplicate-free-page", "out-of-range-free-page"])
def test_check_invariants_catches_corrupted_free_list(corrupt: str) -> None:
    """A free list holding a page twice (or a page id the pool never had) is caught."""
    mgr = _busy_manager()  # pages 0-2 owned, 3-5 free
    lost = mgr.pool._free.pop()
    mgr.pool._free.append(mgr.pool._free[0] if corrupt == "duplicate-free-page" else 99)
    assert lost not in mgr.pool.free_ids()
    with pytest.raises(AssertionError):
        mgr.check_invariants()
