"""The BufferManager seam: who owns which pages and state slots.

Bookkeeping (pages, block tables, slots) is plain Python on the engine's side so the scheduler can consult
it cheaply; it touches no tensor. The device tensors those indices address (KV pages, state pools) belong
to each tensor-parallel rank's model runner (``device_buffers.DeviceBuffers``), allocated once from the
same memory plan, so an index means the same page or slot on every rank.
"""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod

from pegainfer.engine.request import Request
from pegainfer.memory.memory_plan import MemoryPlan


class BlockPool:
    """A free list of page ids. ``allocate`` returns None instead of raising when the pool is short."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        # Popped from the end: freshly freed pages are reused first (they are warm in cache).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        if n == 0:
            return []
        taken = self._free[-n:]
        del self._free[-n:]
        taken.reverse()
        return taken

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))

    def free_ids(self) -> list[int]:
        return list(self._free)


class BufferManager(ABC):
    """Hands out one replica's pages, block tables and recurrent-state slots (indices into the device
    buffers every rank allocated from ``plan``).

    Rules: a request's block table only grows while it holds pages (append-only), so a consumer may
    cache a copy and write only the entries added since. ``free`` returns every page and slot of a
    request at once. Indices are valid until the request is freed. A state slot a request takes holds
    whatever its last owner left: the model runner zeroes it when the request's first chunk (position 0)
    runs.
    """

    block_size: int
    plan: MemoryPlan

    @abstractmethod
    def can_admit(self, request: Request, num_new_tokens: int) -> bool:
        """Whether ``request`` could take a state slot and the pages for its first ``num_new_tokens``."""

    @abstractmethod
    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for ``num_new_tokens`` more tokens after the computed ones (taking a state slot on first
        use). Returns False, changing nothing, when pages are short: the scheduler then preempts."""

    @abstractmethod
    def free(self, request: Request) -> None:
        """Return all pages and the state slot of ``request``. Idempotent."""

    @abstractmethod
    def block_table(self, request_id: str) -> list[int]:
        """The page ids of ``request_id`` in token order: a live list (do not mutate), the same one, extended
        in place, for as long as the request holds its pages."""

    @abstractmethod
    def state_slot(self, request_id: str) -> int | None:
        """The recurrent-state slot of ``request_id`` (the same until the request is freed), or None when the
        model has no recurrent state."""

    @abstractmethod
    def usage(self) -> float:
        """Fraction of pages in use."""

    @property
    def num_free_pages(self) -> int:
        """Pages no request holds (0 when unknown: callers then assume memory is short)."""
        return 0

    @abstractmethod
    def check_invariants(self) -> None:
        """Raise AssertionError if a page or slot is owned twice or lost (used by tests)."""


class PagedBufferManager(BufferManager):
    """The default manager: one page pool shared by every paged layer, one slot pool for recurrent state."""

    def __init__(self, plan: MemoryPlan) -> None:
        self.plan = plan
        self.block_size = plan.block_size
        self.pool = BlockPool(plan.num_blocks)
        self._tables: dict[str, list[int]] = {}
        # Tokens each request's pages cover (all of them without paged layers) once it holds its pages and
        # its slot: allocate_slots' common case is one lookup.
        self._capacity: dict[str, int] = {}
        self._slots: dict[str, int] = {}
        self._free_slots: list[int] = list(range(plan.num_state_slots - 1, -1, -1))
        self._has_state = plan.num_state_slots > 0
        self._paged = plan.page_bytes > 0

    def _pages_needed(self, request: Request, num_new_tokens: int) -> int:
        if not self._paged:
            return 0
        total = request.num_computed_tokens + num_new_tokens
        have = len(self._tables.get(request.request_id, ()))
        return max(0, -(-total // self.block_size) - have)

    def can_admit(self, request: Request, num_new_tokens: int) -> bool:
        if self._has_state and request.request_id not in self._slots and not self._free_slots:
            return False
        return self._pages_needed(request, num_new_tokens) <= self.pool.num_free

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        rid = request.request_id
        if request.num_computed_tokens + num_new_tokens <= self._capacity.get(rid, -1):
            return True  # the common decode step: the last page still has room (no page needed)
        need = self._pages_needed(request, num_new_tokens)
        if self._has_state and rid not in self._slots and not self._free_slots:
            return False
        pages = self.pool.allocate(need)
        if pages is None:
            return False
        self._tables.setdefault(rid, []).extend(pages)
        if self._has_state and rid not in self._slots:
            self._slots[rid] = self._free_slots.pop()
        self._capacity[rid] = len(self._tables[rid]) * self.block_size if self._paged else sys.maxsize
        return True

    def free(self, request: Request) -> None:
        rid = request.request_id
        self._capacity.pop(rid, None)
        pages = self._tables.pop(rid, None)
        if pages:
            self.pool.free(pages)
        slot = self._slots.pop(rid, None)
        if slot is not None:
            self._free_slots.append(slot)

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def state_slot(self, request_id: str) -> int | None:
        return self._slots.get(request_id)

    def usage(self) -> float:
        total = self.pool.num_blocks
        return 0.0 if total == 0 else 1.0 - self.pool.num_free / total

    @property
    def num_free_pages(self) -> int:
        return self.pool.num_free

    @property
    def num_active(self) -> int:
        return len(self._tables)

    def check_invariants(self) -> None:
        owned = [p for table in self._tables.values() for p in table]
        free = self.pool.free_ids()
        assert len(owned) == len(set(owned)), "a page is owned by two requests"
        assert not set(owned) & set(free), "a page is both owned and free"
        assert len(free) == len(set(free)), "a page is on the free list twice"
        assert all(0 <= p < self.pool.num_blocks for p in owned + free), "a page id is out of range"
        assert len(owned) + len(free) == self.pool.num_blocks, "pages were lost"
        for rid, capacity in self._capacity.items():
            assert capacity == (len(self._tables[rid]) * self.block_size if self._paged else sys.maxsize), (
                "a request's recorded capacity is not its pages'"
            )
        slots = list(self._slots.values())
        assert len(self._free_slots) == len(set(self._free_slots)), "a state slot is on the free list twice"
        assert all(0 <= s < self.plan.num_state_slots for s in slots + self._free_slots), (
            "a slot is out of range"
        )
        assert len(slots) == len(set(slots)), "a state slot is owned twice"
        assert not set(slots) & set(self._free_slots), "a state slot is both owned and free"
        assert len(slots) + len(self._free_slots) == self.plan.num_state_slots, "state slots were lost"
