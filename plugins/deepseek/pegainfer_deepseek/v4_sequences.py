"""Where each sequence of a V4 batch is: its rows, positions, state slot and pages.

V4's caches are read per sequence (a sliding window, compressor carry-over, compressed entries), so the
layers walk one list of sequences: the prefill segments in batch order, then each decode row as a
sequence of length 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pegainfer.errors import ExecutorError
from pegainfer.model.model_api import ForwardBatch


@dataclass(frozen=True)
class SequenceRows:
    start: int  # first row in the batch
    length: int
    first_position: int
    slot: int  # the request's state slot
    block_table: torch.Tensor  # [max_blocks] page ids

    @property
    def rows(self) -> slice:
        return slice(self.start, self.start + self.length)

    @property
    def end_position(self) -> int:
        """One past the last position of the chunk (the context length after it)."""
        return self.first_position + self.length


def sequences(batch: ForwardBatch) -> list[SequenceRows]:
    meta = batch.attn
    if batch.state_slots is None:
        raise ExecutorError("DeepSeek-V4 needs a state slot per request, but the batch carries none")
    slots = batch.state_slots.tolist()
    out = [
        SequenceRows(seg.q_start, seg.q_len, seg.ctx_len - seg.q_len, slots[i], seg.block_table)
        for i, seg in enumerate(meta.prefills)
    ]
    if meta.num_decodes:
        first = meta.num_prefill_tokens
        positions = batch.positions[first : first + meta.num_decodes].tolist()
        for i, position in enumerate(positions):
            slot = slots[len(meta.prefills) + i]
            out.append(SequenceRows(first + i, 1, position, slot, meta.decode_block_tables[i]))
    return out


def entry_slots(
    block_table: torch.Tensor, entries: torch.Tensor, ratio: int, block_size: int, rows: int
) -> torch.Tensor:
    """Flat indices into a ``PagedCompressedSpec`` cache ``[blocks, rows, dim]`` of compressed ``entries``:
    entry w lives on the page of token ``w·ratio``, row ``(w·ratio mod block_size) // ratio``."""
    first_token = entries * ratio
    page = block_table[first_token // block_size].long()
    return page * rows + (first_token % block_size) // ratio
