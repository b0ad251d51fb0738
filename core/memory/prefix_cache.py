"""Prefix caching's keys and its snapshot pool (the page cache itself is ``buffer_manager.BlockPool``).

A full page is keyed by a chained hash: SHA-256 of its parent page's key and its token ids (plus, for
pages that hold draft-layer KV, the token after the page, which that KV depends on), the first page's
parent being a root keyed by what else changes the KV (the request's ``cache_salt``, draft-layer KV or
not). Equal keys mean equal tokens from the start of the sequence, so equal KV; SHA-256 keeps a crafted
prompt from colliding with another user's (Python's ``hash`` of int tuples can be steered). A request's
keys are computed once per page and kept on the request (``Request.page_hashes``) for as long as it lives.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable

from pegainfer.engine.request import PENDING_TOKEN, Request

_ROOT = hashlib.sha256(b"pegainfer prefix cache 1").digest()


def known_tokens(ids: list[int]) -> int:
    """How many of ``ids`` are known on the host (the last one may be pending on the device)."""
    return len(ids) - 1 if ids and ids[-1] == PENDING_TOKEN else len(ids)


def page_hashes(
    request: Request, num_pages: int, block_size: int, lookahead: int = 0, salt: bytes = b""
) -> list[bytes]:
    """The keys of ``request``'s first ``num_pages`` full pages (at least: the request's live list of keys,
    extended as needed). Every token they cover (and ``lookahead`` more) must be known."""
    hashes = request.page_hashes
    if len(hashes) >= num_pages:
        return hashes
    ids = request.all_token_ids
    if hashes:
        parent = hashes[-1]
    else:
        user = (request.cache_salt or "").encode()
        parent = hashlib.sha256(_ROOT + salt + len(user).to_bytes(4, "little") + user).digest()
    sha256 = hashlib.sha256
    span = block_size + lookahead
    for k in range(len(hashes), num_pages):
        start = k * block_size
        parent = sha256(parent + array("q", ids[start : start + span]).tobytes()).digest()
        hashes.append(parent)
    return hashes


class SnapshotPool:
    """Snapshot slots: free, being written (a step copies a request's state into them) or published (keyed
    by the key of the page ending at their boundary, found by lookups, least recently used first)."""

    #: Steps a written snapshot may wait for its boundary's tokens to be known before it is given up.
    MAX_PENDING_STEPS = 8

    def __init__(self, num_slots: int, first: int = 0) -> None:
        """Slots ``first .. first + num_slots - 1`` of the snapshot tensors (those before belong to
        speculative decoding's roll-back points)."""
        self.num_slots, self.first = num_slots, first
        self._free: list[int] = list(range(first + num_slots - 1, first - 1, -1))
        self._published: OrderedDict[bytes, int] = OrderedDict()
        # (snapshot slot, request, boundary in pages, step that writes it)
        self._pending: list[tuple[int, Request, int, int]] = []
        self.num_evictions = 0

    @property
    def num_published(self) -> int:
        return len(self._published)

    def find(self, key: bytes, *, touch: bool = True) -> int | None:
        slot = self._published.get(key)
        if slot is not None and touch:
            self._published.move_to_end(key)
        return slot

    def take(self) -> int | None:
        """A slot to write: a free one, else the least recently used published one; None if all are being
        written."""
        if self._free:
            return self._free.pop()
        if self._published:
            _, slot = self._published.popitem(last=False)
            self.num_evictions += 1
            return slot
        return None

    def pend(self, slot: int, request: Request, pages: int, step: int) -> None:
        self._pending.append((slot, request, pages, step))

    def publish(self, step: int, key_of: Callable[[Request, int], bytes | None]) -> None:
        """Publish the snapshots written by steps before ``step`` whose boundary key is known."""
        if not self._pending:
            return
        keep = []
        for entry in self._pending:
            slot, request, pages, written = entry
            if written >= step:
                keep.append(entry)
                continue
            key = key_of(request, pages)
            if key is None:
                if step - written <= self.MAX_PENDING_STEPS:
                    keep.append(entry)
                else:
                    self._free.append(slot)
            elif key in self._published:
                self._free.append(slot)  # another request's snapshot of the same prefix came first
            else:
                self._published[key] = slot
        self._pending = keep

    def drop(self, key: bytes) -> None:
        """Forget the snapshot at the page keyed ``key`` (the page was evicted: nothing can reach it)."""
        slot = self._published.pop(key, None)
        if slot is not None:
            self._free.append(slot)

    def check(self) -> None:
        slots = [*self._free, *self._published.values(), *(p[0] for p in self._pending)]
        assert len(slots) == len(set(slots)), "a snapshot slot is used twice"
        assert all(self.first <= s < self.first + self.num_slots for s in slots), (
            "a snapshot slot is out of range"
        )
        assert len(slots) == self.num_slots, "snapshot slots were lost"
