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

#: The cache slot of a padding row: every cache write skips a negative slot.
PAD_SLOT = -1


def graph_buckets(max_num_seqs: int) -> list[int]:
    """The decode graphs' batch sizes: 1, 2, 4, 8, then multiples of 16 up to ``max_num_seqs`` (which is
    always a bucket); a step's rows are padded to the smallest bucket holding them."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return sorted({*sizes, max_num_seqs})


def _upload_size(max_num_seqs: int) -> int:
    """int64 entries of the uploaded rows: six int64 rows, then the int32 sequence lengths."""
    return 6 * max_num_seqs + -(-max_num_seqs // 2)


def decode_buffers_bytes(max_num_seqs: int, max_blocks_per_seq: int) -> int:
    """Device bytes a :class:`DecodeBuffers` of this shape holds (what the memory plan reserves): the
    sampled tokens and the uploaded rows, the input tokens, the block tables."""
    return 8 * (2 * max_num_seqs + _upload_size(max_num_seqs)) + 4 * max_num_seqs * max_blocks_per_seq


class DecodeBuffers:
    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, device: torch.device) -> None:
        self.max_num_seqs = max_num_seqs
        # The per-row inputs live in one flat int64 buffer so a step uploads them with one contiguous copy
        # from one pinned staging buffer: six int64 rows, then the int32 sequence lengths. Nothing in a step
        # waits for the GPU (the engine may queue the next step first), so the host waits for the previous
        # upload before it rewrites the staging buffers.
        device = torch.device(device)
        pinned = device.type == "cuda"
        size = _upload_size(max_num_seqs)
        # One device buffer: the last step's sampled tokens, then the uploaded rows. The sampled tokens and
        # the staged ones (the first uploaded row) are adjacent, so one gather picks each row's input.
        self._device = torch.zeros(max_num_seqs + size, dtype=torch.int64, device=device)
        #: The last step's sampled tokens in its batch order: where carried rows take their token from.
        #: The decode graph writes its greedy tokens here (in row order: the batch order whenever the rows
        #: are in order, see the executor); ``prepare`` copies any other step's tokens in.
        self.sampled = self._device[:max_num_seqs]
        self._token_pool = self._device[: 2 * max_num_seqs]
        self._upload = self._device[max_num_seqs:]
        self._upload_staging = torch.zeros(size, dtype=torch.int64, pin_memory=pinned)
        self._packed = self._upload[: 6 * max_num_seqs].view(6, max_num_seqs)
        self._staged = self._upload_staging[: 6 * max_num_seqs].view(6, max_num_seqs).numpy()
        (
            # The rows' tokens the host knows (a carried row's is a placeholder 0).
            self.token_ids,
            self.positions,
            self.slot_mapping,
            self.state_slots,
            # Where a row's input token comes from, as an index into [sampled | token_ids]: a carried row's
            # index in the last step's samples, else max_num_seqs + its row (see gather_inputs).
            self.token_index,
            # The row of each request of the batch, in the batch's order (the logits gather).
            self.row_order,
        ) = self._packed.unbind(0)
        #: The model's input tokens (``gather_inputs``: inside the decode graph, no launch on the host).
        self.input_ids = torch.zeros(max_num_seqs, dtype=torch.int64, device=device)
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
        self._sampled_views: dict[int, torch.Tensor] = {}
        self._own_index = np.arange(max_num_seqs, 2 * max_num_seqs, dtype=np.int64)  # row r: its staged token
        self._padded = (0, 0)  # the last prepare's batch and the rows it uploaded (padding included)
        # The last prepare's owners (the caller's list itself) and whether a row carried its token: what
        # ``same_rows`` checks and keeps.
        self._last_request_ids: Sequence[Hashable] | None = None
        self._carries = False
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
        same_rows: bool = False,
    ) -> list[int]:
        """Write one decode row per request; returns each request's row (the batch is rows ``[0, B)``).

        ``request_ids`` are the rows' owners (any hashable keys: a key seen before keeps its row). A
        request whose ``carry_from`` is ``i >= 0`` takes ``sampled[i]`` (the previous step's sampled
        tokens) as its token instead of ``token_ids``' entry, once :meth:`gather_inputs` has run:
        ``carried``, a device tensor of those tokens, is copied into ``sampled`` first; None means the
        caller fills ``sampled`` itself before the gather (a tensor-parallel rank receives rank 0's). With ``pad_to`` the rows up to it are uploaded as padding already (``pad_rows`` then
        has only the block tables left).

        ``same_rows``: the caller passes the last call's ``request_ids`` list again, with the same tokens,
        state slots, carry indices and ``pad_to``; only the positions moved on and the block tables may
        have grown. The staging then keeps the rest, and only positions, slots and lengths are written."""
        if self._upload_done is not None:
            t0 = time.perf_counter()
            self._upload_done.synchronize()  # the last step's upload has left the staging buffers
            self.wait_time_s += time.perf_counter() - t0
        if same_rows and request_ids is self._last_request_ids and self._padded[0] == len(request_ids):
            return self._move_on(positions, block_tables, block_size, carried)
        self._last_request_ids = None  # until this call has written every row
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
        own = self._own_index[rows_np]
        if carry_from is not None:
            index = values[4]
            carries = index >= 0
            # A carried row's staged token is a placeholder (PENDING_TOKEN): stage a valid id instead (the
            # staging goes up whole, and a replay of more rows than a step wrote embeds whatever it holds).
            np.copyto(values[0], 0, where=carries)
            np.copyto(index, own, where=~carries)
            self._carries = bool(carries.any())
            if self._carries and carried is not None:
                self._hold_sampled(carried)
        else:
            values[4] = own
            self._carries = False
        pos = values[1]
        values[2] = self._slots(rows_np, pos, have, block_size)
        staged[:5, at] = values
        lens = self._lens
        lens[at] = pos + 1
        size = batch if pad_to is None or not batch else pad_to
        if size > batch:
            staged[:, batch:size] = staged[:, :1]
            staged[2, batch:size] = PAD_SLOT
            lens[batch:size] = lens[0]
        self._padded = (batch, size)
        self._last_request_ids = request_ids
        self._upload_rows()
        return rows

    def _move_on(
        self,
        positions: Sequence[int],
        block_tables: Sequence[list[int]],
        block_size: int,
        carried: torch.Tensor | None,
    ) -> list[int]:
        """``prepare`` of the last call's rows at new positions (see ``same_rows``)."""
        rows, rows_np, at = self._last_rows, self._last_rows_np, self._last_at
        have = self._write_tables(rows, rows_np, block_tables)
        if self._carries and carried is not None:
            self._hold_sampled(carried)
        pos = np.array(positions, dtype=np.int64)
        staged = self._staged
        staged[1, at] = pos
        staged[2, at] = self._slots(rows_np, pos, have, block_size)
        lens = self._lens
        lens[at] = pos + 1
        batch, size = self._padded
        if size > batch:
            staged[1, batch:size] = staged[1, 0]
            lens[batch:size] = lens[0]
        self._upload_rows()
        return rows

    @property
    def carries(self) -> bool:
        """Whether a row of the last :meth:`prepare` takes its token from ``sampled``."""
        return self._carries

    def _slots(self, rows_np: np.ndarray, pos: np.ndarray, have: np.ndarray, block_size: int) -> np.ndarray:
        """Each row's cache slot for its position: the page's first slot plus the offset in the page."""
        page_index = pos // block_size
        if (page_index >= have).any():
            raise IndexError("a decode position lies past its request's block table")
        return self._tables[rows_np, page_index] * np.int64(block_size) + (pos - page_index * block_size)

    def _upload_rows(self) -> None:
        self._upload.copy_(self._upload_staging, non_blocking=self._non_blocking)
        if self._upload_done is not None:
            self._upload_done.record()

    def _hold_sampled(self, carried: torch.Tensor) -> None:
        """Make ``sampled`` hold the last step's tokens ``carried`` (nothing to do when they are the decode
        graph's own greedy tokens, already there)."""
        sampled = self.sampled
        if carried.dim() != 1 or len(carried) > len(sampled):
            raise ValueError(
                f"carried tokens must be a vector of at most {len(sampled)}, got {tuple(carried.shape)}"
            )
        if (
            carried.data_ptr() != sampled.data_ptr()
            or carried.stride(0) != 1
            or carried.dtype != sampled.dtype
        ):
            sampled[: len(carried)].copy_(carried)

    def sampled_rows(self, n: int) -> torch.Tensor:
        """``sampled[:n]``, a view made once per size (a slice is a dispatch every step otherwise)."""
        view = self._sampled_views.get(n)
        if view is None:
            view = self._sampled_views[n] = self.sampled[:n]
        return view

    def gather_inputs(self, size: int) -> torch.Tensor:
        """Each of rows ``[0, size)``'s input token, staged or carried, into ``input_ids`` (one gather; the
        decode graph runs it first, so carried tokens cost the host no launch)."""
        return torch.index_select(self._token_pool, 0, self.token_index[:size], out=self.input_ids[:size])

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
        """Make rows ``[batch, size)`` copies of row 0 but for their cache slot, which is :data:`PAD_SLOT`,
        so a graph captured for ``size`` rows reads valid pages and state and writes no page. (Their state
        slot is row 0's: the recurrent-state kernels skip a later row with row 0's slot, reading zeros, so
        such a row computes other values than row 0 and must not write row 0's page.) Rows past the batch
        have no owner, so their cached block tables need no bookkeeping (a new owner rewrites its row in
        full)."""
        if size == batch:
            return
        if self._padded[0] != batch or self._padded[1] < size:  # not uploaded padded by prepare(pad_to=)
            self._packed[:, batch:size] = self._packed[:, :1]
            self.slot_mapping[batch:size] = PAD_SLOT
            self.seq_lens[batch:size] = self.seq_lens[0]
        self.block_tables[batch:size] = self.block_tables[0]
        self._blocks_written[batch:size] = 0
