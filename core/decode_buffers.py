"""Persistent decode input buffers, sized for ``max_num_seqs`` rows and written in place every step.

A request keeps its row while it decodes; when requests leave, the rows above the new batch size move
down into the holes (and only those rows are rewritten). A row's block table is rewritten only when the
row changes owner or the owner's page list grew — and then only the new tail. This is the structure the
GPU path captures in CUDA graphs: the graph reads these exact tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class DecodeBuffers:
    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, device: torch.device) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        # The per-row int64 inputs live in one [4, rows] tensor so a step uploads them with one copy from
        # one pinned staging buffer (reused every step: each step ends with a sync, so the last copy is done).
        device = torch.device(device)
        self._packed = torch.zeros(4, max_num_seqs, dtype=torch.int64, device=device)
        self._staging = torch.zeros(4, max_num_seqs, dtype=torch.int64, pin_memory=device.type == "cuda")
        self._staged = self._staging.numpy()
        self.token_ids, self.positions, self.slot_mapping, self.state_slots = self._packed.unbind(0)
        self.seq_lens = torch.zeros(max_num_seqs, dtype=torch.int32, device=device)
        self._lens_staging = torch.zeros(max_num_seqs, dtype=torch.int32, pin_memory=device.type == "cuda")
        self.block_tables = torch.zeros(max_num_seqs, max_blocks_per_seq, dtype=torch.int32, device=device)
        self._owner: list[str | None] = [None] * max_num_seqs
        self._blocks_written = [0] * max_num_seqs
        self._row_of: dict[str, int] = {}
        #: Block-table entries written since start; tests use it to prove unchanged rows are left alone.
        self.block_entries_written = 0

    def _assign_rows(self, request_ids: Sequence[str]) -> list[int]:
        batch = len(request_ids)
        live = set(request_ids)
        for rid in [r for r in self._row_of if r not in live]:
            row = self._row_of.pop(rid)
            self._owner[row] = None
        holes = [r for r in range(batch) if self._owner[r] is None]
        holes.reverse()
        rows = []
        for rid in request_ids:
            row = self._row_of.get(rid)
            if row is None or row >= batch:
                if row is not None:
                    self._owner[row] = None
                row = holes.pop()
                self._row_of[rid] = row
                self._owner[row] = rid
                self._blocks_written[row] = 0
            rows.append(row)
        return rows

    def prepare(
        self,
        request_ids: Sequence[str],
        token_ids: Sequence[int],
        positions: Sequence[int],
        block_tables: Sequence[list[int]],
        state_slots: Sequence[int] | None,
        block_size: int,
    ) -> list[int]:
        """Write one decode row per request; returns each request's row (the batch is rows ``[0, B)``)."""
        rows = self._assign_rows(request_ids)
        batch = len(rows)
        order = np.argsort(np.asarray(rows, dtype=np.int64))
        tok = np.asarray(token_ids, dtype=np.int64)[order]
        pos = np.asarray(positions, dtype=np.int64)[order]
        slots = np.empty(batch, dtype=np.int64)
        for i, j in enumerate(order):
            table, p = block_tables[j], pos[i]
            slots[i] = table[p // block_size] * block_size + p % block_size
            row, have = rows[j], len(table)
            written = self._blocks_written[row]
            if have > written:
                self.block_tables[row, written:have] = torch.as_tensor(table[written:have], dtype=torch.int32)
                self.block_entries_written += have - written
                self._blocks_written[row] = have
        staged = self._staged
        staged[0, :batch] = tok
        staged[1, :batch] = pos
        staged[2, :batch] = slots
        fields = 3  # without state slots, that row of the buffer is left as it is
        if state_slots is not None:
            staged[3, :batch] = np.asarray(state_slots, dtype=np.int64)[order]
            fields = 4
        self._packed[:fields, :batch].copy_(self._staging[:fields, :batch], non_blocking=True)
        lens = self._lens_staging.numpy()
        lens[:batch] = pos + 1
        self.seq_lens[:batch].copy_(self._lens_staging[:batch], non_blocking=True)
        return rows

    def pad_rows(self, batch: int, size: int) -> None:
        """Make rows ``[batch, size)`` copies of row 0, so a graph captured for ``size`` rows reads valid
        pages and writes only row 0's own slot (with row 0's own values). Rows past the batch have no
        owner, so their cached block tables need no bookkeeping (a new owner rewrites its row in full)."""
        if size == batch:
            return
        self._packed[:, batch:size] = self._packed[:, :1]
        self.seq_lens[batch:size] = self.seq_lens[0]
        self.block_tables[batch:size] = self.block_tables[0]
        for row in range(batch, size):
            self._blocks_written[row] = 0
