"""Persistent decode input buffers, sized for ``max_num_seqs`` rows and written in place every step.

A request keeps its row while it decodes; when requests leave, the rows above the new batch size move
down into the holes (and only those rows are rewritten). A row's block table is rewritten only when the
row changes owner or the owner's page list grew — and then only the new tail. This is the structure the
GPU path captures in CUDA graphs: the graph reads these exact tensors.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch


class DecodeBuffers:
    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, device: torch.device) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        # The per-row int64 inputs live in one [6, rows] tensor so a step uploads them with one copy from
        # one pinned staging buffer. Nothing in a step waits for the GPU (the engine may queue the next
        # step first), so the host waits for the previous upload before it rewrites the staging buffers.
        device = torch.device(device)
        pinned = device.type == "cuda"
        self._packed = torch.zeros(6, max_num_seqs, dtype=torch.int64, device=device)
        self._staging = torch.zeros(6, max_num_seqs, dtype=torch.int64, pin_memory=pinned)
        self._staged = self._staging.numpy()
        (
            self.token_ids,
            self.positions,
            self.slot_mapping,
            self.state_slots,
            # Where a row's token comes from when the host does not know it yet: an index into the
            # previous step's sampled tokens (still on the device), or -1.
            self.carry_from,
            # The row of each request of the batch, in the batch's order (the logits gather).
            self.row_order,
        ) = self._packed.unbind(0)
        self.seq_lens = torch.zeros(max_num_seqs, dtype=torch.int32, device=device)
        self._lens_staging = torch.zeros(max_num_seqs, dtype=torch.int32, pin_memory=pinned)
        self.block_tables = torch.zeros(max_num_seqs, max_blocks_per_seq, dtype=torch.int32, device=device)
        self._tables_staging = torch.zeros(
            max_num_seqs, max_blocks_per_seq, dtype=torch.int32, pin_memory=pinned
        )
        # numpy views of the host staging: writing through them costs no torch op dispatch (a step's
        # host time is mostly such per-op overhead on a GPU host: bench/host_overhead.py --count-ops).
        self._tables_np = self._tables_staging.numpy()
        self._lens_np = self._lens_staging.numpy()
        self._upload_done = torch.cuda.Event() if pinned else None
        self._non_blocking = pinned
        self._owner: list[str | None] = [None] * max_num_seqs
        self._blocks_written = [0] * max_num_seqs
        self._row_of: dict[str, int] = {}
        #: Block-table entries written since start; tests use it to prove unchanged rows are left alone.
        self.block_entries_written = 0
        #: Seconds spent waiting for the previous upload (host-time accounting in the benchmarks).
        self.wait_time_s = 0.0

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
        *,
        carry_from: Sequence[int] | None = None,
        carried: torch.Tensor | None = None,
    ) -> list[int]:
        """Write one decode row per request; returns each request's row (the batch is rows ``[0, B)``).

        A request whose ``carry_from`` is ``i >= 0`` takes ``carried[i]`` (a device tensor of the previous
        step's sampled tokens) as its token instead of ``token_ids``' entry."""
        if self._upload_done is not None:
            t0 = time.perf_counter()
            self._upload_done.synchronize()  # the last step's upload has left the staging buffers
            self.wait_time_s += time.perf_counter() - t0
        rows = self._assign_rows(request_ids)
        batch = len(rows)
        order = np.argsort(np.asarray(rows, dtype=np.int64))
        pos = np.asarray(positions, dtype=np.int64)[order]
        staged = self._staged
        staged[0, :batch] = np.asarray(token_ids, dtype=np.int64)[order]
        staged[1, :batch] = pos
        staged[3, :batch] = 0 if state_slots is None else np.asarray(state_slots, dtype=np.int64)[order]
        staged[4, :batch] = -1 if carry_from is None else np.asarray(carry_from, dtype=np.int64)[order]
        staged[5, :batch] = rows
        tables, tables_np = self._tables_staging, self._tables_np
        for i, j in enumerate(order):
            table, p = block_tables[j], pos[i]
            staged[2, i] = table[p // block_size] * block_size + p % block_size
            row, have = rows[j], len(table)
            written = self._blocks_written[row]
            if have > written:
                tables_np[row, written:have] = table[written:have]
                self.block_tables[row, written:have].copy_(
                    tables[row, written:have], non_blocking=self._non_blocking
                )
                self.block_entries_written += have - written
                self._blocks_written[row] = have
        self._packed[:, :batch].copy_(self._staging[:, :batch], non_blocking=self._non_blocking)
        self._lens_np[:batch] = pos + 1
        self.seq_lens[:batch].copy_(self._lens_staging[:batch], non_blocking=self._non_blocking)
        if self._upload_done is not None:
            self._upload_done.record()
        if carried is not None and carry_from is not None:
            src, tokens = self.carry_from[:batch], self.token_ids[:batch]
            tokens.copy_(torch.where(src >= 0, carried[src.clamp(min=0)], tokens))
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
