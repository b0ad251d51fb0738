"""A batch's decode rows as the per-row lists ``DecodeBuffers.prepare`` takes, gathered from its chunks."""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pegainfer.executor.model_batch import ModelBatch, SequenceChunk

# Field getters for the per-row lists (C-level, one pass each). A row's owner is the request (serials are
# unique per process) in its preemption epoch.
_ROW_OWNER = attrgetter("serial", "request_id", "epoch")
_START = attrgetter("start")
_BLOCK_TABLE = attrgetter("block_table")
_CARRY_FROM = attrgetter("carry_from")


@dataclass
class DecodeRows:
    """A batch's one-token decode chunks and their row inputs but the positions, gathered once: the
    executor keeps them while the engine moves the batch on (``ModelBatch.moved_on``), which changes only
    the chunks' positions."""

    batch: ModelBatch
    chunks: list[SequenceChunk]
    owners: list[tuple[int, str, int]]
    token_ids: list[int]
    block_tables: list[list[int]]
    state_slots: list[int]
    carry_from: list[int]

    @classmethod
    def of(cls, batch: ModelBatch, decodes: list[SequenceChunk]) -> DecodeRows:
        return cls(
            batch,
            decodes,
            list(map(_ROW_OWNER, decodes)),
            [c.token_ids[0] for c in decodes],
            list(map(_BLOCK_TABLE, decodes)),
            [c.state_slot or 0 for c in decodes],
            list(map(_CARRY_FROM, decodes)),
        )

    def positions(self) -> list[int]:
        """Each row's position this step."""
        return list(map(_START, self.chunks))
