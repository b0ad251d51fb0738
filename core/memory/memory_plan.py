"""The memory plan: reserve every transient first, then size state slots, state snapshots (prefix caching of
hybrid models, or speculative decoding's roll-back points) and the page pool from the rest."""

from __future__ import annotations

from dataclasses import dataclass, field

from pegainfer.errors import ConfigError
from pegainfer.memory.buffer_specs import (
    PAGED_SPECS,
    BufferSpec,
    RecurrentStateSpec,
    TransientSpec,
    page_bytes,
)


@dataclass(frozen=True)
class MemoryPlan:
    """How one model replica's memory budget is split. All figures in bytes."""

    budget: int
    weight_bytes: int
    transients: dict[str, int] = field(default_factory=dict)
    num_state_slots: int = 0
    state_bytes_per_slot: int = 0
    block_size: int = 16
    num_blocks: int = 0
    page_bytes: int = 0
    #: Copies of a state slot (each ``state_bytes_per_slot``), a pool apart from the requests' slots: prefix
    #: caching keeps them at page boundaries; speculative decoding owns the first
    #: ``num_state_slots * draft_snapshots_per_slot``, slot ``s``'s roll-back points at
    #: ``s * draft_snapshots_per_slot + j`` (the state after j accepted drafts).
    num_snapshot_slots: int = 0
    draft_snapshots_per_slot: int = 0

    @property
    def num_cache_snapshots(self) -> int:
        """The snapshots prefix caching keeps: those after speculative decoding's roll-back points."""
        return self.num_snapshot_slots - self.num_state_slots * self.draft_snapshots_per_slot

    @property
    def transient_bytes(self) -> int:
        return sum(self.transients.values())

    @property
    def state_bytes(self) -> int:
        return self.num_state_slots * self.state_bytes_per_slot

    @property
    def kv_bytes(self) -> int:
        return self.num_blocks * self.page_bytes

    @property
    def snapshot_bytes(self) -> int:
        return self.num_snapshot_slots * self.state_bytes_per_slot

    @property
    def cache_bytes(self) -> int:
        """Everything a request's context occupies: pages, state slots and state snapshots."""
        return self.kv_bytes + self.state_bytes + self.snapshot_bytes

    def describe(self) -> str:
        gib = 1 << 20
        parts = ", ".join(f"{k} {v / gib:.1f}" for k, v in self.transients.items())
        return (
            f"memory plan (MiB): budget {self.budget / gib:.1f}, weights {self.weight_bytes / gib:.1f}, "
            f"transients {self.transient_bytes / gib:.1f} [{parts}], state slots {self.num_state_slots} x "
            f"{self.state_bytes_per_slot / gib:.2f}, state snapshots {self.num_snapshot_slots}, pages "
            f"{self.num_blocks} x {self.page_bytes / 1024:.1f} KiB; cache {self.cache_bytes / gib:.1f} in all"
        )


def plan_memory(
    *,
    budget: int,
    weight_bytes: int,
    specs: list[BufferSpec],
    transients: list[TransientSpec],
    block_size: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    num_blocks_override: int | None = None,
    prefix_caching: bool = False,
    num_state_snapshots: int | None = None,
    draft_snapshots_per_seq: int = 0,
    cap_pages: bool = True,
) -> MemoryPlan:
    """Split ``budget`` (everything this replica may hold, weights included) into its parts.

    Transients are reserved at their worst case before anything else; every admitted request needs one
    state slot, so there are ``max_num_seqs`` slots; with ``prefix_caching`` a model with state also gets
    ``num_state_snapshots`` snapshots (None: ``max_num_seqs``, at most a tenth of what the slots leave, at
    least one unless that leaves too little for one request's pages); with ``draft_snapshots_per_seq``
    (speculative decoding of ``k`` drafts: k) a model with state also gets that many per slot, before
    those, where a verification's state is kept after each draft it may roll back to;
    pages get what is left, at most what ``max_num_seqs`` full-length requests use when ``cap_pages``
    (more pages then only cost allocation time). Raises ConfigError when not even one request of
    ``max_model_len`` tokens fits.
    """
    reserved = {t.role: t.bytes_for(max_num_batched_tokens, max_num_seqs) for t in transients}
    paged = [s for s in specs if isinstance(s, PAGED_SPECS)]
    state_per_slot = sum(s.bytes_per_request for s in specs if isinstance(s, RecurrentStateSpec))
    num_slots = max_num_seqs if state_per_slot else 0
    bytes_per_page = sum(page_bytes(s, block_size) for s in paged)
    free = budget - weight_bytes - sum(reserved.values()) - num_slots * state_per_slot
    num_snapshots = 0
    per_slot = draft_snapshots_per_seq if state_per_slot else 0
    free -= num_slots * per_slot * state_per_slot
    if prefix_caching and state_per_slot and paged:
        if num_state_snapshots is None:
            num_snapshots = max(1, min(max_num_seqs, max(free, 0) // 10 // state_per_slot))
            if num_blocks_override is None:
                # Never so many that a plan which fits without them fails: what one request's pages leave.
                spare = free - -(-max_model_len // block_size) * bytes_per_page
                num_snapshots = min(num_snapshots, max(spare, 0) // state_per_slot)
        else:
            num_snapshots = num_state_snapshots
        free -= num_snapshots * state_per_slot
    num_snapshots += num_slots * per_slot  # the roll-back points come first in the pool
    if num_blocks_override is not None:
        num_blocks = num_blocks_override
    elif bytes_per_page == 0:
        num_blocks = 0
    else:
        # More pages than max_num_seqs full-length requests can use would only cost allocation time.
        num_blocks = max(free, 0) // bytes_per_page
        if cap_pages:
            num_blocks = min(num_blocks, max_num_seqs * -(-max_model_len // block_size))
    if num_blocks_override is None and free < 0:
        raise ConfigError(
            f"weights ({weight_bytes} B), transients ({sum(reserved.values())} B), state slots "
            f"({num_slots * state_per_slot} B) and state snapshots ({num_snapshots * state_per_slot} B) exceed "
            f"the memory budget ({budget} B); lower scheduler.max_num_batched_tokens, scheduler.max_num_seqs, "
            "cache.num_state_snapshots or speculative.num_tokens, or raise the budget"
        )
    blocks_for_one = -(-max_model_len // block_size)
    if paged and num_blocks < blocks_for_one:
        raise ConfigError(
            f"the page pool holds {num_blocks} pages of {block_size} tokens, fewer than one request of "
            f"max_model_len={max_model_len} tokens needs ({blocks_for_one}); lower model.max_model_len or "
            "scheduler.max_num_batched_tokens, or raise cache.gpu_memory_utilization / cache.cpu_kv_cache_bytes"
        )
    return MemoryPlan(
        budget=budget,
        weight_bytes=weight_bytes,
        transients=reserved,
        num_state_slots=num_slots,
        state_bytes_per_slot=state_per_slot,
        block_size=block_size,
        num_blocks=num_blocks,
        page_bytes=bytes_per_page,
        num_snapshot_slots=num_snapshots,
        draft_snapshots_per_slot=per_slot,
    )
