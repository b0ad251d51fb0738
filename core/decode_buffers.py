"""Persistent decode input buffers, sized for ``max_num_seqs`` rows and written in place every step.

A request keeps its row while it decodes; when requests leave, the rows above the new batch size move
down into the holes (and only those rows are rewritten). A row's block table is rewritten only when the
row changes owner or the owner's page list grew — and then only the new tail. This is the structure the
GPU path captures in CUDA graphs: the graph reads these exact tensors.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence

import numpy as np
import torch

#: Several grown block-table rows are uploaded as one copy of the rows between them (unchanged rows are
#: rewritten with the same entries) while that span is at most this many bytes; else one copy per row.
RANGE_COPY_BYTES = 64 << 10


class DecodeBuffers:
    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, device: torch.device) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        # The per-row inputs live in one flat int64 buffer so a step uploads them with one contiguous copy
        # from one pinned staging buffer: six int64 rows, then the int32 sequence lengths. Nothing in a step
        # waits for the GPU (the engine may queue the next step first), so the host waits for the previous
        # upload before it rewrites the staging buffers.
        device = torch.device(device)
        pinned = device.type == "cuda"
        size = 6 * max_num_seqs + -(-max_num_seqs // 2)
        self._upload = torch.zeros(size, dtype=torch.int64, device=device)
        self._upload_staging = torch.zeros(size, dtype=torch.int64, pin_memory=pinned)
        self._packed = self._upload[: 6 * max_num_seqs].view(6, max_num_seqs)
        self._staged = self._upload_staging[: 6 * max_num_seqs].view(6, max_num_seqs).numpy()
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
        self.seq_lens = self._upload[6 * max_num_seqs :].view(torch.int32)[:max_num_seqs]
        self._lens = self._upload_staging[6 * max_num_seqs :].view(torch.int32)[:max_num_seqs].numpy()
        self.block_tables = torch.zeros(max_num_seqs, max_blocks_per_seq, dtype=torch.int32, device=device)
        self._tables_staging = torch.zeros(
            max_num_seqs, max_blocks_per_seq, dtype=torch.int32, pin_memory=pinned
        )
        # The host's copy of every owned row's table entries (``[:_blocks_written[row]]``).
        self._tables = self._tables_staging.numpy()
        self._upload_done = torch.cuda.Event() if pinned else None
        self._non_blocking = pinned
        self._owner: list[Hashable | None] = [None] * max_num_seqs
        self._blocks_written = np.zeros(max_num_seqs, dtype=np.int64)
        self._row_of: dict[Hashable, int] = {}
        # The last batch's keys and rows: a batch of the same requests in the same order keeps its rows.
        self._last_keys: list[Hashable] = []
        self._last_rows: list[int] = []
        self._last_rows_np = np.zeros(0, dtype=np.int64)
        self._last_at: slice | np.ndarray = slice(0, 0)
        self._views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._padded = (0, 0)  # the last prepare's batch and the rows it uploaded (padding included)
        #: Block-table entries written since start; tests use it to prove unchanged rows are left alone.
        self.block_entries_written = 0
        #: Seconds spent waiting for the previous upload (host-time accounting in the benchmarks).
        self.wait_time_s = 0.0

    def _assign_rows(self, request_ids: Sequence[Hashable]) -> list[int]:
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
        request_ids: Sequence[Hashable],
        token_ids: Sequence[int],
        positions: Sequence[int],
        block_tables: Sequence[list[int]],
        state_slots: Sequence[int] | None,
        block_size: int,
        *,
        carry_from: Sequence[int] | None = None,
        carried: torch.Tensor | None = None,
        pad_to: int | None = None,
    ) -> list[int]:
        """Write one decode row per request; returns each request's row (the batch is rows ``[0, B)``).

        ``request_ids`` are the rows' owners (any hashable keys: a key seen before keeps its row). A
        request whose ``carry_from`` is ``i >= 0`` takes ``carried[i]`` (a device tensor of the previous
        step's sampled tokens) as its token instead of ``token_ids``' entry. With ``pad_to`` the rows up
        to it are uploaded as copies of row 0 already (``pad_rows`` then has only the block tables left)."""
        if self._upload_done is not None:
            t0 = time.perf_counter()
            self._upload_done.synchronize()  # the last step's upload has left the staging buffers
            self.wait_time_s += time.perf_counter() - t0
        batch = len(request_ids)
        staged = self._staged
        if request_ids == self._last_keys:  # the same requests as last step, in the same order: same rows
            rows, rows_np, at = self._last_rows, self._last_rows_np, self._last_at
        else:
            rows = self._assign_rows(request_ids)
            rows_np = np.array(rows, dtype=np.int64)
            # Where the batch's values go: rows usually are the batch's order, else each to its row.
            at = slice(0, batch) if rows == list(range(batch)) else rows_np
            self._last_keys, self._last_rows, self._last_rows_np, self._last_at = (
                list(request_ids),
                rows,
                rows_np,
                at,
            )
            staged[5, :batch] = rows_np  # the row order (the staging keeps it while the batch repeats)
        have = self._write_tables(rows, rows_np, block_tables)
        # Rows 0-4 of the staging in the batch's order, converted at once: token, position, slot (below),
        # state slot, carry index.
        values = np.array(
            (
                token_ids,
                positions,
                positions,
                [0] * batch if state_slots is None else state_slots,
                [-1] * batch if carry_from is None else carry_from,
            ),
            dtype=np.int64,
        )
        if carried is not None and carry_from is not None:
            # A carried row's token id is a placeholder (PENDING_TOKEN) until the device gather below. The
            # staging is uploaded whole every step, so a placeholder left in it would overwrite the row's
            # gathered token on the device again in every later step where the row lies past the batch:
            # stage a valid id (0) instead. (Rows past the step's rows are read by graphs.run(batch) called
            # for more rows than the last step wrote, e.g. the benchmark's replays after requests finished.)
            np.copyto(values[0], 0, where=values[4] >= 0)
        pos = values[1]
        page_index = pos // block_size
        if (page_index >= have).any():
            raise IndexError("a decode position lies past its request's block table")
        slots = values[2]
        slots -= page_index * block_size  # the offset in the page ...
        slots += self._tables[rows_np, page_index] * np.int64(block_size)  # ... plus the page's first slot
        staged[:5, at] = values
        lens = self._lens
        lens[at] = pos + 1
        size = batch if pad_to is None or not batch else pad_to
        if size > batch:
            staged[:, batch:size] = staged[:, :1]
            lens[batch:size] = lens[0]
        self._padded = (batch, size)
        self._upload.copy_(self._upload_staging, non_blocking=self._non_blocking)
        if self._upload_done is not None:
            self._upload_done.record()
        if carried is not None and carry_from is not None and batch:
            src, tokens = self._carry_views(size)  # padding rows gather row 0's token
            if min(carry_from) >= 0 and carried.dtype == tokens.dtype:
                torch.index_select(
                    carried, 0, src, out=tokens
                )  # every row carries (async decode): one gather
            elif max(carry_from) >= 0:
                tokens.copy_(torch.where(src >= 0, carried[src.clamp(min=0)], tokens))
        return rows

    def _carry_views(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``carry_from[:batch]`` and ``token_ids[:batch]``, made once per batch size."""
        views = self._views.get(batch)
        if views is None:
            views = self._views[batch] = (self.carry_from[:batch], self.token_ids[:batch])
        return views

    def _write_tables(
        self, rows: list[int], rows_np: np.ndarray, block_tables: Sequence[list[int]]
    ) -> np.ndarray:
        """Write the entries each row's owner added since its row was last written (a new owner: all);
        returns every table's length."""
        have = np.fromiter(map(len, block_tables), dtype=np.int64, count=len(block_tables))
        grown = np.flatnonzero(have > self._blocks_written[rows_np])
        if not len(grown):
            return have
        tables, written = self._tables, self._blocks_written
        spans = []
        for j in grown.tolist():
            row, table, end = rows[j], block_tables[j], int(have[j])
            start = int(written[row])
            tables[row, start:end] = table[start:end]
            spans.append((row, start, end))
            self.block_entries_written += end - start
            written[row] = end
        lo, hi = min(r for r, _, _ in spans), max(r for r, _, _ in spans) + 1
        if len(spans) > 1 and (hi - lo) * self._tables.shape[1] * 4 <= RANGE_COPY_BYTES:
            # One copy of rows lo..hi-1: rows between keep their entries (the host copy holds them too).
            self.block_tables[lo:hi].copy_(self._tables_staging[lo:hi], non_blocking=self._non_blocking)
            return have
        for row, start, end in spans:
            self.block_tables[row, start:end].copy_(
                self._tables_staging[row, start:end], non_blocking=self._non_blocking
            )
        return have

    def pad_rows(self, batch: int, size: int) -> None:
        """Make rows ``[batch, size)`` copies of row 0, so a graph captured for ``size`` rows reads valid
        pages and writes only row 0's own slot (with row 0's own values). Rows past the batch have no
        owner, so their cached block tables need no bookkeeping (a new owner rewrites its row in full)."""
        if size == batch:
            return
        if self._padded[0] != batch or self._padded[1] < size:  # not uploaded padded by prepare(pad_to=)
            self._packed[:, batch:size] = self._packed[:, :1]
            self.seq_lens[batch:size] = self.seq_lens[0]
        self.block_tables[batch:size] = self.block_tables[0]
        self._blocks_written[batch:size] = 0
