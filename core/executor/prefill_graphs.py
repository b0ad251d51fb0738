"""CUDA-graph prefill: short prefill-only steps replayed from graphs captured per token-count bucket.

A short prefill step (a prompt's tail after a prefix hit, a short prompt) is bound by the host's launches
when it runs eagerly (docs/benchmarks.md, "Prefix caching"): its kernels take a fraction of the time the
host takes to issue them. Such a step writes its tokens and segments into ``PrefillGraphInputs``, which
pads the rest, and replays the graph of the smallest bucket holding its tokens. The rows each segment
samples get their logits (a prompt's last row; a verification chunk's known token and its drafts, up to
``PrefillGraphInputs.rows_per_segment``) in a static ``[max_segments * rows_per_segment, V]`` output,
and every token its final hidden state (kept for a drafting request's MTP pass), both valid until the
next step.

Only a model whose forward reads the segments from their device form runs in a graph
(``CausalLM.prefill_graph_tokens``). Its batch says ``in_graph``, its ``prefills`` are ``max_segments``
placeholders bounded by the bucket, and the real values are in ``derived``: the attention's packed
tensors ("prefill_tensors", CUDA only, with the bucket as the longest query), the varlen bounds
("cu_seqlens") and the segments' block tables ("segment_tables", ``[max_segments, max_blocks]``).
With ``eager`` the same padded forward runs without a graph and with the real segments on the host
(``enforce_eager``; the reference paths on the CPU run it too), ``derived`` holding the same tensors.

The drafter's passes take the same machinery with their own inputs (``forward``: the MTP module over
hidden states written into a static input, see ``ModelRunner.propose``): a pass over a step's kept
positions is a prefill of short segments, a chained draft one of one-token segments.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

from pegainfer.executor.cuda_graphs import capture_buckets
from pegainfer.executor.model_batch import SequenceChunk
from pegainfer.layers.attention import AttentionMetadata, PrefillSegment
from pegainfer.memory.buffer_specs import CacheKey
from pegainfer.memory.prefill_graph_inputs import PrefillGraphInputs
from pegainfer.model.model_api import CausalLM, ForwardBatch, StateCheckpoints

logger = logging.getLogger(__name__)


class PrefillGraphs:
    def __init__(
        self,
        model: CausalLM,
        inputs: PrefillGraphInputs,
        caches: dict[CacheKey, torch.Tensor],
        states: dict[int, dict[str, torch.Tensor]],
        snapshots: dict[int, dict[str, torch.Tensor]],
        *,
        block_size: int,
        max_model_len: int,
        buckets: list[int],
        eager: bool = False,
        forward: Callable[[ForwardBatch], tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> None:
        """``forward(batch) -> (logits of inputs.logit_rows_of(its tokens), hidden states of every token)``:
        by default the model's forward and its logits."""
        self.model = model
        self.forward = forward or self._model_forward
        self.inputs = inputs
        self.caches, self.states = caches, states
        # Snapshot pools for in-chunk checkpoints (roll-back points, caching snapshots), for a model that
        # takes them.
        self.snapshots = snapshots if model.snapshot_inside_chunk_tokens else {}
        self.block_size, self.max_model_len = block_size, max_model_len
        self.buckets = sorted(buckets)
        self.eager = eager
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]] = {}
        #: Seconds in graph launches (one launched while the last replay still runs may block on it).
        self.launch_s = 0.0

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    def takes(self, chunks: Sequence[SequenceChunk]) -> bool:
        """Whether a prefill-only step of ``chunks`` runs here: few enough tokens and segments, and few
        enough sampled rows a chunk (prompt logprobs take the eager path)."""
        rows = self.inputs.rows_per_segment
        return (
            len(chunks) <= self.inputs.max_segments
            and sum(len(c.token_ids) for c in chunks) <= self.max_tokens
            and all(c.num_logits <= rows and not c.all_logits for c in chunks)
        )

    def bucket_for(self, tokens: int) -> int:
        for size in self.buckets:
            if size >= tokens:
                return size
        raise ValueError(f"{tokens} tokens exceed the largest prefill graph ({self.max_tokens})")

    def _batch(
        self,
        size: int,
        segments: list[PrefillSegment] | None,
        checkpoints: Sequence[tuple[int, int, int]] | None,
    ) -> ForwardBatch:
        """The bucket's batch: with ``segments`` (eager) the real ones and the step's ``checkpoints`` on
        the host, else the graph's placeholders (always with the checkpoint tensors, which say -1 where a
        step has none)."""
        inp = self.inputs
        in_graph = segments is None
        if in_graph:
            segments = [PrefillSegment(0, size, size, inp.block_tables[s]) for s in range(inp.max_segments)]
        meta = AttentionMetadata(
            block_size=self.block_size,
            slot_mapping=inp.slot_mapping[:size],
            prefills=segments,
            num_prefill_tokens=size,
            in_graph=in_graph,
        )
        if inp.input_ids.is_cuda:
            # The graph's attention tensors, eager too: the keys' split (key_splits) follows the context
            # bound, so enforce_eager computes the graph's numbers only with the graph's bound.
            from pegainfer.kernels.paged_prefill_attention import PrefillTensors  # CUDA only (see ops)

            meta.derived["prefill_tensors"] = PrefillTensors(
                inp.q_start, inp.q_len, inp.ctx_len, inp.block_tables, max_q_len=size,
                max_ctx_len=self.max_model_len,
            )  # fmt: skip
        # The segments' device form, eager too: a model may read only it (prefill_graph_rows), so that
        # enforce_eager computes the graph's numbers.
        meta.derived["cu_seqlens"] = inp.cu_seqlens
        meta.derived["segment_tables"] = inp.block_tables
        if in_graph:
            # The host pairs are read by the reference paths only, which a graph never runs.
            checkpoints = [(-1, -1, 0)] * len(segments)
        ckpt = None
        if checkpoints is not None and self.snapshots:
            ckpt = StateCheckpoints(
                inp.checkpoint_tokens,
                inp.checkpoint_slots,
                inp.checkpoint_counts,
                list(checkpoints),
                self.snapshots,
            )
        return ForwardBatch(
            inp.input_ids[:size],
            inp.positions[:size],
            meta,
            state_slots=inp.state_slots if self.states else None,
            checkpoints=ckpt,
        )

    def _model_forward(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        batch.hidden_states = self.model.input_embeddings(batch.token_ids)
        hidden = self.model(batch, self.caches, self.states)
        rows = self.inputs.logit_rows_of(batch.token_ids.shape[0])
        return self.model.compute_logits(hidden.index_select(0, rows)), hidden

    @torch.inference_mode()
    def capture(self, pool) -> None:
        """Capture every bucket, largest first, into ``pool`` (the decode graphs' pool: no two graphs
        replay at once). The inputs are all padding meanwhile: nothing is read or written but scratch."""
        if self.eager:
            return
        self.inputs.clear()
        torch.cuda.synchronize()
        self._graphs = capture_buckets(
            self.buckets, lambda size: self.forward(self._batch(size, None, None)), pool
        )
        logger.info("captured prefill CUDA graphs for %s tokens", self.buckets)

    def run(
        self,
        chunks: Sequence[SequenceChunk],
        state_slots: Sequence[int] | None,
        checkpoints: Sequence[tuple[int, int, int]] | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step of ``chunks`` (``takes`` them), with their state slots and in-chunk checkpoints
        ``(tokens, snapshot slot, count)``: the logits of the last ``num_logits`` rows of each chunk in
        chunk order ``[sum of num_logits, V]``, and the final hidden states of the chunks' tokens."""
        inp = self.inputs
        tokens = inp.prepare(
            [(c.token_ids, c.start, c.block_table) for c in chunks],
            state_slots,
            checkpoints,
            self.block_size,
            [c.num_logits for c in chunks],
        )
        rows = sum(c.num_logits for c in chunks)
        size = self.bucket_for(tokens)
        if self.eager:
            segments = inp.segments(len(chunks), self.block_size)
            logits, hidden = self.forward(self._batch(size, segments, checkpoints))
        else:
            graph, (logits, hidden) = self._graphs[size]
            t0 = time.perf_counter()
            graph.replay()
            self.launch_s += time.perf_counter() - t0
        return logits[:rows], hidden[:tokens]
