"""CUDA-graph decode: one graph per batch-size bucket, captured at start-up into one memory pool.

The graphs read the persistent decode buffers (token ids — gathered from the staged ones and the last
step's samples, then embedded inside the graph, by the model's forward or, for a model that does not embed
on the device, by its ``embed`` —, positions, sequence lengths, slot mapping, block
tables, state slots) and write logits into a static output and their argmax into ``decode.sampled``. A
step writes its rows into the buffers, pads the bucket with copies of row 0 that write no cache page
(padding rows read valid pages and state; see ``DecodeBuffers.pad_rows``) and replays. With ``eager`` the same
padded forward runs without a graph (``enforce_eager``), with identical numerics.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

import torch

from pegainfer import ops
from pegainfer.layers.attention import AttentionMetadata
from pegainfer.memory.buffer_specs import CacheKey
from pegainfer.memory.decode_buffers import DecodeBuffers
from pegainfer.model.model_api import CausalLM, ForwardBatch
from pegainfer.parallel.distributed import TensorParallel

logger = logging.getLogger(__name__)

T = TypeVar("T")


_CAPTURE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The one side stream every capture on ``device`` runs on. cuBLAS keeps a workspace for each stream
    it ran on (32 MiB on Hopper) for as long as the process lives: a stream per set of graphs (decode,
    prefill, draft) kept three, 64 MiB more than this one (measured on the H200, docs/gpu-checks.md)."""
    device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
    if device not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[device] = torch.cuda.Stream(device)
    return _CAPTURE_STREAMS[device]


def capture_buckets(
    sizes: list[int], forward: Callable[[int], T], pool
) -> dict[int, tuple[torch.cuda.CUDAGraph, T]]:
    """``size -> (graph, its output)`` of ``forward(size)`` for every size, on the capture stream into
    ``pool``: largest first, so smaller graphs reuse what the largest reserved, each after one eager run
    (lazy initialisation and autotuning stay out of the graph)."""
    graphs = {}
    stream = capture_stream(torch.device("cuda"))
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for size in sorted(sizes, reverse=True):
            forward(size)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                out = forward(size)
            graphs[size] = (graph, out)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    return graphs


class DecodeGraphs:
    def __init__(
        self,
        model: CausalLM,
        decode: DecodeBuffers,
        caches: dict[CacheKey, torch.Tensor],
        states: dict[int, dict[str, torch.Tensor]],
        tp: TensorParallel,
        *,
        block_size: int,
        max_model_len: int,
        buckets: list[int],
        eager: bool = False,
    ) -> None:
        self.model = model
        self.decode = decode
        self.caches = caches
        self.states = states
        self.tp = tp
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.buckets = sorted(buckets)
        self.eager = eager
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def _batch(self, size: int) -> ForwardBatch:
        d = self.decode
        meta = AttentionMetadata(
            block_size=self.block_size,
            slot_mapping=d.slot_mapping[:size],
            prefills=[],
            num_prefill_tokens=0,
            num_decodes=size,
            decode_block_tables=d.block_tables[:size],
            decode_seq_lens=d.seq_lens[:size],
            # A static bound: the kernels size their grids from it, so the graph fits every step.
            max_decode_seq_len=self.max_model_len,
        )
        return ForwardBatch(
            d.input_ids[:size],
            d.positions[:size],
            meta,
            state_slots=d.state_slots[:size],
            hidden_states=self.model.input_embeddings(d.input_ids[:size]),  # in the graph too
        )

    def _forward(self, size: int) -> torch.Tensor:
        # Inside the graph: the carried tokens' gather before, the greedy choice after (into ``sampled``,
        # in row order), so neither is a launch on the host (the sampler takes the greedy tokens as they are).
        # Tensor-parallel ranks first take rank 0's ``sampled``: rank 0 alone samples the rows that draw.
        self.tp.broadcast(self.decode.sampled)
        self.decode.gather_inputs(size)
        hidden = self.model(self._batch(size), self.caches, self.states)
        logits = self.model.compute_logits(hidden)
        ops.argmax(logits, out=self.decode.sampled[:size])
        return logits

    @torch.inference_mode()
    def capture(self, pool) -> None:
        """Capture every bucket into ``pool`` (see ``_capture``); nothing with ``eager``."""
        if self.eager:
            return
        self._capture(pool)

    def _capture(self, pool) -> None:
        """Capture every bucket, largest first, so smaller graphs reuse the pool the largest reserved.

        The buffers hold zeros (valid token 0, page 0, length 1) while capturing: no request exists yet, so
        the writes to page 0 during warm-up and capture touch nothing live.
        """
        self.decode.seq_lens.fill_(1)
        self._graphs = capture_buckets(self.buckets, self._forward, pool)
        logger.info("captured decode CUDA graphs for batch sizes %s", self.buckets)

    def bucket_for(self, batch: int) -> int:
        for size in self.buckets:
            if size >= batch:
                return size
        raise ValueError(f"batch {batch} exceeds the largest graph ({self.max_batch})")

    def run(self, batch: int) -> torch.Tensor:
        """Replay for the ``batch`` rows already written into the decode buffers; logits ``[batch, V]``
        (their argmax is in ``decode.sampled[:batch]``, both in row order)."""
        size = self.bucket_for(batch)
        self.decode.pad_rows(batch, size)
        if self.eager:
            # enforce_eager: the same padded shapes without a graph, so both modes compute identical numbers.
            return self._forward(size)[:batch]
        graph, logits = self._graphs[size]
        graph.replay()
        return logits if batch == size else logits[:batch]
