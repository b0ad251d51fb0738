"""The BufferManager seam: who owns which pages, state slots and (prefix caching) cached pages and snapshots.

Bookkeeping (pages, block tables, slots) is plain Python on the engine's side so the scheduler can consult
it cheaply; it touches no tensor. The device tensors those indices address (KV pages, state pools, state
snapshots) belong to each tensor-parallel rank's model runner (``device_buffers.DeviceBuffers``),
allocated once from the same memory plan, so an index means the same page or slot on every rank.

Prefix caching (docs/architecture.md, "Prefix caching"): a full page whose KV is computed is keyed by a
chained hash (``prefix_cache.page_hashes``); requests with the same tokens up to a page share it
(refcounted); a page nobody holds stays cached until a new page is needed, least recently released first.
Models with recurrent state also need the state at the hit boundary: snapshots of a request's state slot
taken at page boundaries, in a pool of their own (``SnapshotPool``).
"""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable

from pegainfer.engine.request import Request, RequestStatus
from pegainfer.memory.memory_plan import MemoryPlan
from pegainfer.memory.prefix_cache import SnapshotPool, known_tokens, page_hashes


class BlockPool:
    """Page ids: free ones, cached ones (hashed, held by nobody: evictable) and held ones (refcounted).

    ``allocate`` hands out never-cached free pages first, then evicts cached pages, least recently released
    first; it returns None instead of raising when the pool is short. Without prefix caching nothing is
    ever hashed and this is a plain free list.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        # Popped from the end: freshly freed pages are reused first (they are warm in cache).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        # Cached pages nobody holds, least recently released first (the eviction order).
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._refs: list[int] = [0] * num_blocks
        self._hash_of: list[bytes | None] = [None] * num_blocks
        self._by_hash: dict[bytes, int] = {}
        #: Called with a page's hash when the page is evicted (the snapshot pool drops what it keyed on it).
        self.on_evict: Callable[[bytes], None] | None = None
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Pages no request holds: never cached or evictable."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Pages with a hash (held or evictable)."""
        return len(self._by_hash)

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self._free) + len(self._evictable):
            return None
        if n == 0:
            return []
        k = min(n, len(self._free))
        taken = self._free[len(self._free) - k :]
        del self._free[len(self._free) - k :]
        taken.reverse()
        for _ in range(n - k):
            page, _ = self._evictable.popitem(last=False)
            self._forget(page)
            taken.append(page)
        refs = self._refs
        for page in taken:
            refs[page] = 1
        return taken

    def _forget(self, page: int) -> None:
        h = self._hash_of[page]
        self._hash_of[page] = None
        del self._by_hash[h]
        self.num_evictions += 1
        if self.on_evict is not None:
            self.on_evict(h)

    def free(self, blocks: list[int]) -> None:
        """Release one hold on each page of ``blocks`` (a request's table, in token order). A page nobody
        holds any more goes back: a cached one to the evictable end (the table's last pages first, so they
        are evicted before the pages the others chain from), an uncached one to the free list."""
        refs, hash_of = self._refs, self._hash_of
        for page in reversed(blocks):
            refs[page] -= 1
            if refs[page] == 0:
                if hash_of[page] is None:
                    self._free.append(page)
                else:
                    self._evictable[page] = None

    def lookup(self, h: bytes) -> int | None:
        """The cached page with hash ``h``."""
        return self._by_hash.get(h)

    def hash_of(self, page: int) -> bytes | None:
        return self._hash_of[page]

    def hold(self, pages: list[int]) -> None:
        """Take a hold on cached pages (a prefix hit): an evictable one leaves the evictable set."""
        refs = self._refs
        for page in pages:
            if refs[page] == 0:
                del self._evictable[page]
            refs[page] += 1

    def num_evictable_of(self, pages: list[int]) -> int:
        """How many of ``pages`` (cached ones) nobody holds: taking them costs free pages."""
        refs = self._refs
        return sum(1 for page in pages if refs[page] == 0)

    def register(self, page: int, h: bytes) -> bool:
        """Key a held, full page by ``h``. False when another page has that key already (this one stays
        private and returns to the free list when released)."""
        if h in self._by_hash or self._hash_of[page] is not None:
            return False
        self._by_hash[h] = page
        self._hash_of[page] = h
        return True

    def free_ids(self) -> list[int]:
        return list(self._free) + list(self._evictable)

    def check(self, owners: dict[int, int]) -> None:
        """Raise AssertionError unless ``owners`` (page -> tables holding it) agrees with the pool."""
        free, evictable = self._free, list(self._evictable)
        assert all(0 <= p < self.num_blocks for p in [*owners, *free, *evictable]), (
            "a page id is out of range"
        )
        assert len(free) == len(set(free)), "a page is on the free list twice"
        for page, n in owners.items():
            assert n == self._refs[page], (
                f"page {page} is owned by two requests but not shared (refcount {self._refs[page]}, held by {n})"
                if n > 1
                else f"page {page} is held by {n} tables, refcount {self._refs[page]}"
            )
            assert n == 1 or self._hash_of[page] is not None, f"page {page} is owned by two requests unhashed"
        assert not set(owners) & (set(free) | set(evictable)), "a page is both owned and free"
        assert not set(free) & set(evictable), "a page is both free and cached"
        assert all(self._hash_of[p] is None for p in free), "a free page still has a hash"
        assert all(self._hash_of[p] is not None for p in evictable), "an evictable page has no hash"
        assert len(owners) + len(free) + len(evictable) == self.num_blocks, "pages were lost"
        assert all(self._refs[p] == 0 for p in [*free, *evictable]), "a free page is held"
        for h, page in self._by_hash.items():
            assert self._hash_of[page] == h, "the hash index disagrees with the pages' hashes"
        assert sum(h is not None for h in self._hash_of) == len(self._by_hash), "a hashed page is not indexed"


class BufferManager(ABC):
    """Hands out one replica's pages, block tables and recurrent-state slots (indices into the device
    buffers every rank allocated from ``plan``).

    Rules: a request's block table only grows while it holds pages (append-only), so a consumer may
    cache a copy and write only the entries added since. ``free`` returns every page and slot of a
    request at once. Indices are valid until the request is freed. A state slot a request takes holds
    whatever its last owner left: the model runner zeroes it when the request's first chunk (position 0)
    runs, or restores it from a snapshot when the request resumes from a cached prefix.

    Prefix caching: ``find_cached_prefix`` names the tokens a waiting request may skip; the scheduler sets
    ``num_computed_tokens`` to them before ``can_admit``/``allocate_slots``, which then take the cached
    pages instead of new ones. Pages of a table may then be shared with other requests: they are full and
    never written again. A manager without prefix caching finds nothing.
    """

    block_size: int
    plan: MemoryPlan
    #: Whether prefill chunks must end at snapshot boundaries (``chunk_limit``, ``plan_snapshots``).
    cuts_chunks: bool = False

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

    def begin_step(self) -> None:  # noqa: B027 - optional hook: nothing to do without prefix caching
        """Called by the scheduler before it plans a step (the last step has run)."""

    def find_cached_prefix(self, request: Request) -> int:
        """Tokens at the start of waiting ``request`` whose KV (and state) is cached: a multiple of the page
        size, always short of the last token (its logits are needed). 0 without prefix caching."""
        return 0

    def waits_for_shared_prefix(self, request: Request) -> bool:
        """Whether waiting ``request`` (its cached prefix found this step) should wait a step: the next page
        of its prompt is being computed by a request scheduled this step, so it is cached next step and
        computing it twice wastes the step. False without prefix caching."""
        return False

    def chunk_limit(self, request: Request, num_new_tokens: int) -> int:
        """``num_new_tokens`` cut so the chunk ends at the next snapshot boundary it would cross (a short
        chunk may keep one inside, see ``PagedBufferManager``)."""
        return num_new_tokens

    def plan_snapshots(self, scheduled: list) -> None:  # noqa: B027 - optional hook
        """Snapshot the state of planned chunks at the snapshot boundaries where they end or that they
        keep inside (``cuts_chunks`` only)."""

    def plan_draft_checkpoints(self, scheduled: list) -> None:  # noqa: B027 - optional hook
        """Speculative decoding of a model with state: the forward keeps each planned verification chunk's
        state after its known tokens and after each draft but the last (``roll_back_state``'s points)."""

    def roll_back_state(self, request: Request, accepted: int) -> None:  # noqa: B027 - optional hook
        """After a verification of ``request`` that accepted ``accepted`` of its drafts but not all: its
        state slot is restored, before the next forward, to the state after those drafts (nothing to do
        for a model without state)."""

    def take_state_copies(
        self,
    ) -> tuple[list[tuple[int, int]], list[tuple[int, int]], list[tuple[int, int, int, int]]]:
        """The step's (state slot, snapshot slot) restores and saves, and its (state slot, snapshot slot,
        tokens, count) checkpoints inside chunks (``ModelBatch.state_checkpoints``), handed over once."""
        return [], [], []

    @property
    def prefix_cache_stats(self) -> tuple[int, int]:
        """(prompt tokens looked up, of which cached) over the requests admitted so far."""
        return 0, 0

    @abstractmethod
    def check_invariants(self) -> None:
        """Raise AssertionError if a page or slot is owned twice or lost (used by tests)."""


class PagedBufferManager(BufferManager):
    """The default manager: one page pool shared by every paged layer, one slot pool for recurrent state
    and, with ``prefix_caching``, the page cache and (models with state) a snapshot pool.

    ``snapshot_interval_pages``: a snapshot every so many pages (besides the last page boundary of every
    prompt). ``snapshot_inside_chunk_tokens`` (the model's ``CausalLM.snapshot_inside_chunk_tokens``): a
    chunk of at most that many tokens is not cut at the first boundary lacking a snapshot that it crosses;
    the forward saves the state there instead (a checkpoint), so a short prompt tail costs one step, not
    two. ``drafts(request)``: whether the request's pages also hold draft-layer (MTP) KV, which depends on
    the token after each position: its pages are keyed apart, with that token.
    """

    def __init__(
        self,
        plan: MemoryPlan,
        *,
        prefix_caching: bool = False,
        snapshot_interval_pages: int = 128,
        snapshot_inside_chunk_tokens: int = 0,
        drafts: Callable[[Request], bool] | None = None,
    ) -> None:
        self.plan = plan
        self.block_size = plan.block_size
        self.pool = BlockPool(plan.num_blocks)
        self._tables: dict[str, list[int]] = {}
        # The end (computed + new tokens) up to which allocate_slots has nothing to do but return True: the
        # request's pages cover it and no page of it is due to be keyed. allocate_slots' common case is one
        # lookup.
        self._fast: dict[str, int] = {}
        self._slots: dict[str, int] = {}
        self._free_slots: list[int] = list(range(plan.num_state_slots - 1, -1, -1))
        self._has_state = plan.num_state_slots > 0
        self._paged = plan.page_bytes > 0
        self.caching = prefix_caching and self._paged and plan.num_blocks > 0
        if self.caching and self._has_state and not plan.num_cache_snapshots:
            self.caching = False  # the state at a hit boundary could not be restored
        self.cuts_chunks = self.caching and self._has_state
        # The pool's first snapshots are speculative decoding's roll-back points (``roll_back_state``).
        roll_backs = plan.num_snapshot_slots - plan.num_cache_snapshots
        self.snapshots = SnapshotPool(plan.num_cache_snapshots if self.cuts_chunks else 0, roll_backs)
        self.pool.on_evict = self.snapshots.drop if self.cuts_chunks else None
        self._interval = snapshot_interval_pages * self.block_size
        self._inside_tokens = snapshot_inside_chunk_tokens
        self._drafts = drafts
        # Pages at the start of each table that are keyed (computed and hashed, or taken from the cache).
        self._registered: dict[str, int] = {}
        # A waiting request's cached prefix found this step: (pages, their hashes, snapshot slot).
        self._hits: dict[str, tuple[list[int], list[bytes], int | None]] = {}
        # Models with state: where a request's cached pages ended past its snapshot (its prefix is shared
        # that far: a snapshot there serves the next request sharing it).
        self._divergence: dict[str, int] = {}
        self._restores: list[tuple[int, int]] = []
        self._saves: list[tuple[int, int]] = []
        self._checkpoints: list[tuple[int, int, int, int]] = []
        # Keys of the full pages the chunks scheduled this step complete (-> request id): cached next step.
        self._in_flight: dict[bytes, str] = {}
        self._queries = 0
        self._hit_tokens = 0
        self._step = 0

    # ------------------------------------------------------------------------------------------ keys

    def _lookahead(self, request: Request) -> int:
        return 1 if self._drafts is not None and self._drafts(request) else 0

    def _hashes(self, request: Request, num_pages: int) -> list[bytes]:
        lookahead = self._lookahead(request)
        salt = b"mtp" if lookahead else b""
        return page_hashes(request, num_pages, self.block_size, lookahead, salt)

    def _hashable_pages(self, request: Request, limit: int) -> int:
        """Full pages among the first ``limit`` tokens whose keys are known (every token of them, and the
        token after for a drafting request)."""
        known = known_tokens(request.all_token_ids) - self._lookahead(request)
        return max(0, min(limit, known)) // self.block_size

    def _register(self, request: Request, table: list[int]) -> None:
        """Key the request's full, computed pages that are not keyed yet."""
        rid = request.request_id
        done = self._registered.get(rid, 0)
        n = min(self._hashable_pages(request, request.num_computed_tokens), len(table))
        if n <= done:
            return
        hashes = self._hashes(request, n)
        register = self.pool.register
        for k in range(done, n):
            register(table[k], hashes[k])
        self._registered[rid] = n

    def _mark_in_flight(self, request: Request, end: int) -> None:
        """The keys of the full pages this step's chunk of ``request`` completes (tokens up to ``end``)."""
        first, last = self._registered.get(request.request_id, 0), self._hashable_pages(request, end)
        if last > first:
            for h in self._hashes(request, last)[first:last]:
                self._in_flight.setdefault(h, request.request_id)

    def waits_for_shared_prefix(self, request: Request) -> bool:
        if not self._in_flight:
            return False
        cached = request.num_computed_tokens // self.block_size
        if self._hashable_pages(request, request.num_tokens - 1) <= cached:
            return False
        owner = self._in_flight.get(self._hashes(request, cached + 1)[cached])
        return owner is not None and owner != request.request_id

    def _next_event(self, request: Request, table: list[int]) -> int:
        """The fast-path limit: the request's capacity, or less when one of its pages is due to be keyed."""
        capacity = len(table) * self.block_size if self._paged else sys.maxsize
        if not self.caching:
            return capacity
        # The next page is keyed once it is computed: an end beyond its end means it may be.
        return min(capacity, (self._registered.get(request.request_id, 0) + 1) * self.block_size)

    # ----------------------------------------------------------------------------------------- lookup

    def begin_step(self) -> None:
        self._step += 1
        self._hits.clear()
        self._in_flight.clear()
        if self.cuts_chunks:
            self.snapshots.publish(self._step, self._boundary_key)

    def find_cached_prefix(self, request: Request) -> int:
        rid = request.request_id
        if not self.caching or rid in self._tables or request.sampling_params.prompt_logprobs is not None:
            return 0  # prompt logprobs need every position's logits: nothing may be skipped
        # Always short of the last token: its logits are sampled (a full hit still computes one token).
        n = self._hashable_pages(request, request.num_tokens - 1)
        if n == 0:
            return 0
        hashes = self._hashes(request, n)[:n]
        lookup = self.pool.lookup
        pages: list[int] = []
        best, snap = 0, None
        for h in hashes:
            page = lookup(h)
            if page is None:
                break
            pages.append(page)
            if self.cuts_chunks:
                slot = self.snapshots.find(h)
                if slot is not None:
                    best, snap = len(pages), slot
        if not self.cuts_chunks:
            best = len(pages)
        elif len(pages) > best:
            self._divergence[rid] = len(pages) * self.block_size  # where its first chunk is cut
        else:
            self._divergence.pop(rid, None)
        if best == 0:
            return 0
        self._hits[rid] = (pages[:best], hashes[:best], snap)
        return best * self.block_size

    def _take_hit(self, request: Request) -> tuple[list[int], int | None]:
        """The cached pages (and snapshot) ``find_cached_prefix`` found for ``request`` this step, if the
        scheduler took them (``num_computed_tokens`` is their length) and they are still cached."""
        hit = self._hits.get(request.request_id)
        if hit is None or request.num_computed_tokens == 0:
            return [], None
        pages, hashes, snap = hit
        if request.num_computed_tokens != len(pages) * self.block_size:
            raise RuntimeError(
                f"{request.request_id}: {request.num_computed_tokens} computed tokens at admission, but "
                f"{len(pages) * self.block_size} cached"
            )
        hash_of = self.pool.hash_of
        if any(hash_of(p) != h for p, h in zip(pages, hashes, strict=True)):
            raise RuntimeError(f"{request.request_id}: its cached prefix was evicted before admission")
        return pages, snap

    # ------------------------------------------------------------------------------------- allocation

    def _pages_needed(self, request: Request, num_new_tokens: int) -> int:
        if not self._paged:
            return 0
        total = request.num_computed_tokens + num_new_tokens
        table = self._tables.get(request.request_id)
        if table is not None:
            return max(0, -(-total // self.block_size) - len(table))
        pages, _ = self._take_hit(request)
        # Cached pages nobody holds leave the free pool when taken: they count as new ones.
        return max(0, -(-total // self.block_size) - len(pages)) + self.pool.num_evictable_of(pages)

    def can_admit(self, request: Request, num_new_tokens: int) -> bool:
        if self._has_state and request.request_id not in self._slots and not self._free_slots:
            return False
        return self._pages_needed(request, num_new_tokens) <= self.pool.num_free

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        rid = request.request_id
        computed = request.num_computed_tokens
        if computed + num_new_tokens <= self._fast.get(rid, -1):
            return True  # the common decode step: the last page still has room (nothing to allocate or key)
        table = self._tables.get(rid)
        if table is None:
            return self._admit(request, num_new_tokens)
        need = max(0, -(-(computed + num_new_tokens) // self.block_size) - len(table)) if self._paged else 0
        pages = self.pool.allocate(need)
        if pages is None:
            return False
        table.extend(pages)
        if self.caching:
            self._register(request, table)
            self._mark_in_flight(request, computed + num_new_tokens)
        self._fast[rid] = self._next_event(request, table)
        return True

    def _admit(self, request: Request, num_new_tokens: int) -> bool:
        """A request's first allocation: its state slot, its cached prefix's pages, new pages for the rest."""
        rid = request.request_id
        if self._has_state and rid not in self._slots and not self._free_slots:
            return False
        hit, snap = self._take_hit(request)
        if self._paged:
            total = request.num_computed_tokens + num_new_tokens
            need = max(0, -(-total // self.block_size) - len(hit))
            if need + self.pool.num_evictable_of(hit) > self.pool.num_free:
                return False
            self.pool.hold(hit)  # before allocating: the new pages must not evict the hit's
            table = hit + self.pool.allocate(need)
        else:
            table = []
        self._tables[rid] = table
        self._registered[rid] = len(hit)
        self._hits.pop(rid, None)
        if self._has_state and rid not in self._slots:
            self._slots[rid] = self._free_slots.pop()
        if snap is not None:
            self._restores.append((self._slots[rid], snap))
        if self.caching:
            self._mark_in_flight(request, request.num_computed_tokens + num_new_tokens)
        if self.caching and request.num_preemptions == 0:
            self._queries += request.num_prompt_tokens
            self._hit_tokens += request.num_computed_tokens
            request.num_cached_tokens = request.num_computed_tokens
        self._fast[rid] = self._next_event(request, table)
        return True

    # -------------------------------------------------------------------------------------- snapshots

    def _next_boundary(self, request: Request, after: int) -> int:
        """The first snapshot boundary past ``after``: every ``snapshot_interval_pages`` pages, the prompt's
        last page boundary short of its last token (what a repeat of the prompt can hit), and where the
        request's cached pages ended past its snapshot (the prefix it shares with an earlier request)."""
        boundary = (after // self._interval + 1) * self._interval
        prompt_end = (request.num_prompt_tokens - 1) // self.block_size * self.block_size
        if after < prompt_end < boundary:
            boundary = prompt_end
        shared = self._divergence.get(request.request_id, 0)
        return shared if after < shared < boundary else boundary

    def _boundary_key(self, request: Request, pages: int) -> bytes | None:
        """The key of the request's page ending at boundary ``pages`` (None while a token of it is unknown)."""
        if self._hashable_pages(request, pages * self.block_size) < pages:
            return None
        return self._hashes(request, pages)[pages - 1]

    def _has_snapshot(self, request: Request, boundary: int) -> bool:
        pages = boundary // self.block_size
        if self._hashable_pages(request, boundary) < pages:
            return False
        return self.snapshots.find(self._hashes(request, pages)[pages - 1], touch=False) is not None

    def chunk_limit(self, request: Request, num_new_tokens: int) -> int:
        if not self.cuts_chunks or request.sampling_params.prompt_logprobs is not None:
            return num_new_tokens
        start = request.num_computed_tokens
        end = start + num_new_tokens
        boundary = self._unsnapshotted_boundary(request, start, end)
        if boundary < end and num_new_tokens <= self._inside_tokens:  # one may stay inside (a checkpoint)
            boundary = self._unsnapshotted_boundary(request, boundary, end)
        return boundary - start

    def _unsnapshotted_boundary(self, request: Request, after: int, end: int) -> int:
        """The first snapshot boundary in ``(after, end)`` that has no snapshot, else ``end``."""
        boundary = self._next_boundary(request, after)
        while boundary < end and self._has_snapshot(request, boundary):
            boundary = self._next_boundary(request, boundary)
        return min(boundary, end)

    def _is_boundary(self, request: Request, position: int) -> bool:
        if position % self._interval == 0 or position == self._divergence.get(request.request_id):
            return True
        return position == (request.num_prompt_tokens - 1) // self.block_size * self.block_size

    def plan_snapshots(self, scheduled: list) -> None:
        """For each planned chunk ending at a snapshot boundary that has no snapshot yet: copy the request's
        slot into a snapshot after the step's forward; for a short chunk keeping such a boundary inside
        (``chunk_limit``), a checkpoint the forward saves there. A snapshot is published (found by lookups)
        once that step has run and the boundary's tokens are known.

        A verification chunk (speculative decoding) is skipped: which of its tokens stay is known only after
        the forward, whose in-chunk saves are the roll-back points. So a boundary its drafts cross (one
        every ``snapshot_interval_pages`` of generated text) gets no snapshot, and a later hit resumes from
        the boundary before it."""
        if not self.cuts_chunks:
            return
        for item in scheduled:
            if item.spec_token_ids:
                continue
            request, start = item.request, item.start
            end = start + item.num_new_tokens
            # A boundary strictly inside needs two tokens or more (a decode row has none).
            if 1 < item.num_new_tokens <= self._inside_tokens:
                inside = self._unsnapshotted_boundary(request, start, end)
                if inside < end and not self._snapshot(request, inside, start):
                    return
            if end % self.block_size or not self._is_boundary(request, end):
                continue
            if not self._has_snapshot(request, end) and not self._snapshot(request, end, None):
                return

    def _snapshot(self, request: Request, boundary: int, chunk_start: int | None) -> bool:
        """Plan the snapshot of ``request``'s state at ``boundary``: after the forward when the chunk ends
        there (``chunk_start`` None), else by the forward after the chunk's first ``boundary -
        chunk_start`` tokens. False when every snapshot slot is still being written (nothing planned)."""
        slot = self.snapshots.take()
        if slot is None:
            return False
        state = self._slots[request.request_id]
        if chunk_start is None:
            self._saves.append((state, slot))
        else:
            self._checkpoints.append((state, slot, boundary - chunk_start, 1))
        self.snapshots.pend(slot, request, boundary // self.block_size, self._step)
        return True

    # ------------------------------------------------------------------------- speculative roll-back

    def plan_draft_checkpoints(self, scheduled: list) -> None:
        per_slot = self.plan.draft_snapshots_per_slot
        if not per_slot:
            return
        for item in scheduled:
            drafts = len(item.spec_token_ids)
            if drafts:
                # The state after j accepted drafts goes into the slot's j-th roll-back snapshot.
                state = self._slots[item.request.request_id]
                self._checkpoints.append((state, state * per_slot, item.num_new_tokens - drafts, drafts))

    def roll_back_state(self, request: Request, accepted: int) -> None:
        per_slot = self.plan.draft_snapshots_per_slot
        state = self._slots.get(request.request_id)
        if not per_slot or state is None or request.is_finished:
            return
        if not 0 <= accepted < per_slot:
            raise ValueError(f"a roll-back to {accepted} accepted drafts, with {per_slot} snapshots a slot")
        self._restores.append((state, state * per_slot + accepted))

    def take_state_copies(
        self,
    ) -> tuple[list[tuple[int, int]], list[tuple[int, int]], list[tuple[int, int, int, int]]]:
        copies = self._restores, self._saves, self._checkpoints
        if any(copies):
            self._restores, self._saves, self._checkpoints = [], [], []
        return copies

    @property
    def prefix_cache_stats(self) -> tuple[int, int]:
        return self._queries, self._hit_tokens

    # ---------------------------------------------------------------------------------------- release

    def free(self, request: Request) -> None:
        rid = request.request_id
        self._fast.pop(rid, None)
        self._hits.pop(rid, None)
        pages = self._tables.pop(rid, None)
        if pages:
            # A drafting request's last step wrote no draft-layer KV (drafting stops with the request): its
            # keys are only complete when it is preempted (the step before was drafted for).
            if self.caching and (not self._lookahead(request) or request.status is RequestStatus.PREEMPTED):
                self._register(request, pages)
            self.pool.free(pages)
        self._registered.pop(rid, None)
        self._divergence.pop(rid, None)
        slot = self._slots.pop(rid, None)
        if slot is not None:
            # A roll-back still pending for this slot must not reach its next owner.
            self._restores = [r for r in self._restores if r[0] != slot]
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
        owners: dict[int, int] = {}
        for table in self._tables.values():
            assert len(table) == len(set(table)), "a table holds a page twice"
            for p in table:
                owners[p] = owners.get(p, 0) + 1
        self.pool.check(owners)
        for rid, table in self._tables.items():
            done = self._registered.get(rid, 0)
            assert done <= len(table), "more pages keyed than held"
            assert all(self.pool.hash_of(p) is not None for p in table[:done] if owners[p] > 1), (
                "a shared page is not keyed"
            )
            capacity = len(table) * self.block_size if self._paged else sys.maxsize
            assert self._fast.get(rid, -1) <= capacity, "a request's fast-path limit is beyond its pages"
        slots = list(self._slots.values())
        assert len(self._free_slots) == len(set(self._free_slots)), "a state slot is on the free list twice"
        assert all(0 <= s < self.plan.num_state_slots for s in slots + self._free_slots), (
            "a slot is out of range"
        )
        assert len(slots) == len(set(slots)), "a state slot is owned twice"
        assert not set(slots) & set(self._free_slots), "a state slot is both owned and free"
        assert len(slots) + len(self._free_slots) == self.plan.num_state_slots, "state slots were lost"
        self.snapshots.check()
