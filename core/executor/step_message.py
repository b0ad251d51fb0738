"""What travels from rank 0 to the other ranks each step, and how each side keeps its copy.

A message is plain data: per chunk the request id, serial and epoch, the tokens (a carried decode row's
is a placeholder), the first position, the state slot, the logits wanted, and only the block-table
entries the rank does not have yet. Both sides keep each request's table between steps, keyed by
(serial, epoch); a request absent from a step is forgotten by both and sent whole when it returns (its
table only ever grows while it keeps its pages, and a preempted request comes back in a new epoch). A
batch the engine moved on (``ModelBatch.moved_on``) travels as its new positions and grown tables only.
The carried tokens themselves do not travel here: the runners broadcast rank 0's samples on the device.
State-snapshot copies (prefix caching of recurrent state) travel with every batch, moved on or not: each
rank copies its own shard of the state.
"""

from __future__ import annotations

from typing import Any

from pegainfer.errors import ExecutorError
from pegainfer.executor.model_batch import DraftInput, ModelBatch, SequenceChunk

Key = tuple[int, int]  # (serial, epoch)


class StepEncoder:
    """Rank 0's side: turns batches and draft inputs into messages."""

    def __init__(self) -> None:
        self._sent: dict[Key, int] = {}  # table entries each rank holds per request
        self._last: ModelBatch | None = None

    def _delta(self, key: Key, table: list[int], sent: dict[Key, int]) -> tuple[int, list[int]]:
        have = self._sent.get(key, 0)
        sent[key] = len(table)
        return have, table[have:]

    def batch(self, batch: ModelBatch) -> tuple:
        if batch.moved_on and batch is self._last:
            grown = []
            for i, chunk in enumerate(batch.chunks):
                key = (chunk.serial, chunk.epoch)
                if len(chunk.block_table) != self._sent[key]:
                    grown.append((i, *self._delta(key, chunk.block_table, self._sent)))
            return (
                "moved_on",
                [c.start for c in batch.chunks],
                grown,
                batch.state_restores,
                batch.state_saves,
                batch.state_checkpoints,
            )
        sent: dict[Key, int] = {}
        rows = []
        for c in batch.chunks:
            have, new = self._delta((c.serial, c.epoch), c.block_table, sent)
            rows.append(
                (
                    c.request_id,
                    c.serial,
                    c.epoch,
                    c.token_ids,
                    c.start,
                    have,
                    new,
                    c.state_slot,
                    c.num_logits,
                    c.all_logits,
                    c.keep_hidden,
                    c.carry_from,
                )
            )
        self._sent, self._last = sent, batch
        return ("batch", rows, batch.state_restores, batch.state_saves, batch.state_checkpoints)

    def drafts(self, inputs: list[DraftInput]) -> tuple:
        """Draft inputs name requests of the step just sent: their tables are sent as deltas too."""
        rows = []
        for d in inputs:
            have, new = self._delta((d.serial, d.epoch), d.block_table, self._sent)
            rows.append((d.request_id, d.start, d.next_token_ids, d.num_drafts, d.serial, d.epoch, have, new))
        return ("drafts", rows)


class StepDecoder:
    """A rank's side: rebuilds the batches and draft inputs, with the rank's own table lists."""

    def __init__(self) -> None:
        self._tables: dict[Key, list[int]] = {}
        self._last: ModelBatch | None = None

    def _table(self, key: Key, have: int, new: list[int], tables: dict[Key, list[int]]) -> list[int]:
        table = self._tables.get(key, []) if have else []
        if len(table) != have:
            raise ExecutorError(
                f"step message: request {key} has {len(table)} table entries here, not {have}"
            )
        table.extend(new)
        tables[key] = table
        return table

    def batch(self, message: tuple) -> ModelBatch:
        kind = message[0]
        if kind == "moved_on":
            _, starts, grown, restores, saves, checkpoints = message
            batch = self._last
            if batch is None or len(starts) != len(batch.chunks):
                raise ExecutorError("step message: a moved-on batch without the batch it moves on")
            for chunk, start in zip(batch.chunks, starts, strict=True):
                chunk.start = start
            for i, have, new in grown:
                chunk = batch.chunks[i]
                self._table((chunk.serial, chunk.epoch), have, new, self._tables)
            batch.moved_on = True
            batch.state_restores, batch.state_saves, batch.state_checkpoints = restores, saves, checkpoints
            return batch
        tables: dict[Key, list[int]] = {}
        chunks = []
        for rid, serial, epoch, ids, start, have, new, slot, num_logits, all_logits, keep, carry in message[
            1
        ]:
            table = self._table((serial, epoch), have, new, tables)
            chunks.append(
                SequenceChunk(
                    rid, ids, start, table, slot, False, all_logits, epoch, serial, num_logits, keep, carry
                )
            )
        self._tables = tables
        self._last = ModelBatch(
            chunks, state_restores=message[2], state_saves=message[3], state_checkpoints=message[4]
        )
        return self._last

    def drafts(self, message: tuple) -> list[DraftInput]:
        inputs = []
        for rid, start, next_ids, num_drafts, serial, epoch, have, new in message[1]:
            table = self._table((serial, epoch), have, new, self._tables)
            inputs.append(DraftInput(rid, start, next_ids, table, num_drafts, serial, epoch))
        return inputs


def describe(message: Any) -> str:
    """A message's kind, for errors."""
    return message[0] if isinstance(message, tuple) and message else type(message).__name__
