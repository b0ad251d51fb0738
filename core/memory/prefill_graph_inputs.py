"""Persistent inputs of the CUDA-graph prefill steps, rewritten in place by every such step.

A prefill graph is captured for a bucket of tokens over ``max_segments`` segments and reads these exact
tensors: the tokens' ids, positions and cache slots, and the segments' device form (query start, query
length and context length, int32; block tables ``[segments, max_blocks]`` int32; their varlen bounds
``cu_seqlens`` ``[segments + 1]`` int64; state slots; in-chunk checkpoints; the rows whose logits the
segments sample, up to ``rows_per_segment`` each: a prompt's last row, or a verification chunk's known
token and drafts, listed from the front in segment order). A step fills its tokens and segments from the front; the rest is padding that reads
and writes nothing: padding tokens have slot -1 (their K/V are not stored) and lie in no segment, padding
segments have no queries, state slot -1 and no checkpoint.

Everything is staged in pinned host memory and goes up in two copies. Nothing waits for the GPU except
before the staging is rewritten, while the last step's upload may still be reading it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch

from pegainfer.layers.attention import PrefillSegment

#: The most prefill segments (requests) a graph step takes; a step with more runs eagerly.
MAX_SEGMENTS = 16
#: The smallest token bucket; buckets double from here up to the largest. A bucket as small as one token:
#: a step's padding rows run every projection and route to experts like real ones, so an MTP
#: verification (1 + k tokens a request), a draft pass or a one-token prompt tail padded to 16 rows did up
#: to 16 times a decode row's work (DeepSeek's padding rows picked experts of their own, read on top).
SMALLEST_BUCKET = 1


def prefill_graph_buckets(max_tokens: int) -> list[int]:
    """Token counts a prefill graph is captured for: 1, 2, 4, ... below ``max_tokens``, and it."""
    sizes, size = [], SMALLEST_BUCKET
    while size < max_tokens:
        sizes.append(size)
        size *= 2
    return [*sizes, max_tokens] if max_tokens > 0 else []


def prefill_graph_shape(
    model_tokens: int, max_tokens: int, max_batched: int, max_num_seqs: int
) -> tuple[int, int]:
    """(tokens, segments) of the largest prefill graph: at most what the model's forward runs in a graph
    (``CausalLM.prefill_graph_tokens``), the configured cap and a step's token budget; (0, 0): none."""
    tokens = min(model_tokens, max_tokens, max_batched)
    if tokens <= 0:
        return 0, 0
    return tokens, min(MAX_SEGMENTS, max_num_seqs, tokens)


def _layout(t: int, s: int, max_blocks: int, rows_per_segment: int) -> tuple[list[int], int]:
    """The int64 parts' sizes and the int32 count of inputs for ``t`` tokens and ``s`` segments. int64:
    ids, positions, slots [t] each; cu_seqlens [s + 1]; state slots, checkpoint tokens, checkpoint slots,
    checkpoint counts [s] each; logit rows [s * rows_per_segment]. int32: q_start, q_len, ctx_len [s]
    each, then the block tables."""
    return [t, t, t, s + 1, s, s, s, s, s * rows_per_segment], 3 * s + s * max_blocks


def bucket_logit_rows(size: int, max_rows: int) -> int:
    """The logits rows a ``size``-token bucket's graph computes and keeps: every sampled row, of which a
    step of ``size`` tokens has at most ``size`` (``max_rows``: the inputs' ``logit_rows``)."""
    return min(size, max_rows)


def prefill_graph_inputs_bytes(
    max_tokens: int, max_segments: int, max_blocks: int, rows_per_segment: int = 1
) -> int:
    """Device bytes a :class:`PrefillGraphInputs` of this shape holds (what the memory plan reserves)."""
    sizes64, n32 = _layout(max_tokens, max_segments, max_blocks, rows_per_segment)
    return 8 * sum(sizes64) + 4 * n32


class PrefillGraphInputs:
    def __init__(
        self,
        max_tokens: int,
        max_segments: int,
        max_blocks_per_seq: int,
        device: torch.device,
        rows_per_segment: int = 1,
    ) -> None:
        self.max_tokens, self.max_segments, self.max_blocks = max_tokens, max_segments, max_blocks_per_seq
        self.rows_per_segment = rows_per_segment
        device = torch.device(device)
        pinned = device.type == "cuda"
        s = max_segments
        self._sizes64, n32 = _layout(max_tokens, s, max_blocks_per_seq, rows_per_segment)
        n64 = sum(self._sizes64)
        self._staging64 = torch.zeros(n64, dtype=torch.int64, pin_memory=pinned)
        self._staging32 = torch.zeros(n32, dtype=torch.int32, pin_memory=pinned)
        self._device64 = torch.zeros(n64, dtype=torch.int64, device=device)
        self._device32 = torch.zeros(n32, dtype=torch.int32, device=device)
        (
            self.input_ids,
            self.positions,
            self.slot_mapping,
            self.cu_seqlens,
            self.state_slots,
            self.checkpoint_tokens,
            self.checkpoint_slots,
            self.checkpoint_counts,
            self.logit_rows,
        ) = self._device64.split(self._sizes64)
        self.q_start, self.q_len, self.ctx_len = self._device32[: 3 * s].view(3, s).unbind(0)
        self.block_tables = self._device32[3 * s :].view(s, max_blocks_per_seq)
        (
            self._ids,
            self._pos,
            self._slots,
            self._cu,
            self._state,
            self._ckpt_tokens,
            self._ckpt_slots,
            self._ckpt_counts,
            self._rows,
        ) = (part.numpy() for part in self._staging64.split(self._sizes64))
        self._q_start, self._q_len, self._ctx = self._staging32[: 3 * s].view(3, s).numpy()
        self._tables = self._staging32[3 * s :].view(s, max_blocks_per_seq).numpy()
        self._upload_done = torch.cuda.Event() if pinned else None
        self._non_blocking = pinned
        #: Seconds spent waiting for the previous upload (host-time accounting in the benchmarks).
        self.wait_time_s = 0.0
        self.clear()

    def logit_rows_of(self, size: int) -> torch.Tensor:
        """The rows whose logits a ``size``-token bucket computes (``bucket_logit_rows``): the sampled
        rows are listed from the front, so these hold them all."""
        return self.logit_rows[: bucket_logit_rows(size, self.logit_rows.shape[0])]

    def segments(self, count: int, block_size: int) -> list[PrefillSegment]:
        """The last :meth:`prepare`'s first ``count`` segments with their host values (the eager form's
        batch), each reading its block table on the device."""
        return [
            PrefillSegment(
                int(self._q_start[s]),
                int(self._q_len[s]),
                int(self._ctx[s]),
                self.block_tables[s, : -(-int(self._ctx[s]) // block_size)],
            )
            for s in range(count)
        ]

    def clear(self) -> None:
        """Every token and segment padding (what the graphs are captured over)."""
        self.prepare([], None, None, 1, [])

    def prepare(
        self,
        chunks: Sequence[tuple[Sequence[int], int, Sequence[int]]],
        state_slots: Sequence[int] | None,
        checkpoints: Sequence[tuple[int, int, int]] | None,
        block_size: int,
        sampled: Sequence[int] | None = None,
    ) -> int:
        """Write the step's segments, each ``(token ids, first position, block table)``, with their state
        slots, checkpoints ``(tokens, snapshot slot, count)`` (tokens -1: none) and the number of last rows
        each samples (``sampled``; None: one each); pad the rest and upload. Returns the number of tokens
        written."""
        total = sum(len(tokens) for tokens, _, _ in chunks)
        if total > self.max_tokens or len(chunks) > self.max_segments:
            raise ValueError(
                f"a graph prefill step holds at most {self.max_tokens} tokens in {self.max_segments} "
                f"segments, not {total} in {len(chunks)}"
            )
        sampled = [1] * len(chunks) if sampled is None else sampled
        if any(
            not 0 <= r <= min(self.rows_per_segment, len(t))
            for r, (t, _, _) in zip(sampled, chunks, strict=True)
        ):
            raise ValueError(
                f"a graph prefill segment samples at most {self.rows_per_segment} of its rows, not {sampled}"
            )
        if self._upload_done is not None:
            t0 = time.perf_counter()
            self._upload_done.synchronize()  # the last step's upload has left the staging
            self.wait_time_s += time.perf_counter() - t0
        count, n, r, bs = len(chunks), 0, 0, block_size
        for s, ((tokens, start, table), rows) in enumerate(zip(chunks, sampled, strict=True)):
            k, ctx = len(tokens), start + len(tokens)
            pages = np.asarray(table[: -(-ctx // bs)], dtype=np.int64)
            pos = np.arange(start, ctx, dtype=np.int64)
            self._ids[n : n + k] = tokens
            self._pos[n : n + k] = pos
            self._slots[n : n + k] = pages[pos // bs] * bs + pos % bs
            self._tables[s, : len(pages)] = pages
            self._q_start[s], self._q_len[s], self._ctx[s] = n, k, ctx
            self._cu[s] = n
            self._rows[r : r + rows] = np.arange(n + k - rows, n + k)
            n, r = n + k, r + rows
        self._ids[n:], self._pos[n:], self._slots[n:] = 0, 0, -1
        self._cu[count:] = n
        self._q_start[count:], self._q_len[count:], self._ctx[count:] = n, 0, 0
        self._rows[r:] = 0
        self._state[:count] = 0 if state_slots is None else state_slots
        self._state[count:] = -1
        self._ckpt_tokens[:], self._ckpt_slots[:], self._ckpt_counts[:] = -1, 0, 0
        for s, (tokens, snapshot, num) in enumerate(checkpoints or ()):
            self._ckpt_tokens[s], self._ckpt_slots[s], self._ckpt_counts[s] = tokens, max(snapshot, 0), num
        self._device64.copy_(self._staging64, non_blocking=self._non_blocking)
        used32 = 3 * self.max_segments + count * self.max_blocks  # the tables of this step's segments
        self._device32[:used32].copy_(self._staging32[:used32], non_blocking=self._non_blocking)
        if self._upload_done is not None:
            self._upload_done.record()
        return n
