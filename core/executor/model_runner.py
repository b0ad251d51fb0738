"""The model runner: everything on the device side of one tensor-parallel rank.

A runner owns its rank's model shard, its device buffers (page pools and state slots at the rank's
geometry, ``DeviceBuffers``), the persistent decode buffers and rows, the decode CUDA graphs, the
embedding (inside the decode graph, or on the runner's side for models that take hidden states) and
the draft module's kept hidden states. It turns a host-side ``ModelBatch`` into device tensors and runs
the forward; every rank of a group runs the same batch and meets the others in the collectives inside
the model. Rank 0's logits are the ones sampled (every rank computes the gathered logits).

The ``LocalExecutor`` is one runner in the engine's process; the tensor-parallel executor is rank 0's
runner in the engine's process plus one runner per further rank in worker processes.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from pegainfer import ops
from pegainfer.config.schema import EngineConfig
from pegainfer.errors import ExecutorError
from pegainfer.executor.cuda_graphs import DecodeGraphs
from pegainfer.executor.decode_rows import DecodeRows
from pegainfer.executor.model_batch import (
    DraftInput,
    ExecutorCapabilities,
    ExecutorOutput,
    ModelBatch,
    SequenceChunk,
)
from pegainfer.executor.prefill_graphs import PrefillGraphs
from pegainfer.layers.attention import AttentionMetadata, PrefillSegment
from pegainfer.memory.decode_buffers import DecodeBuffers, graph_buckets
from pegainfer.memory.device_buffers import DeviceBuffers
from pegainfer.memory.prefill_graph_inputs import (
    PrefillGraphInputs,
    prefill_graph_buckets,
    prefill_graph_shape,
)
from pegainfer.memory.rank_plan import plan_rank_memory
from pegainfer.model.model_api import ForwardBatch, StateCheckpoints
from pegainfer.model.model_loader import load_model
from pegainfer.parallel.distributed import TensorParallel
from pegainfer.scheduling.speculative import paged_buffer_specs

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelInfo:
    """What the engine knows of the model an executor runs (the same on every rank)."""

    name: str  # the registry name
    folder: Path  # the checkpoint folder (tokenizer, generation_config.json)
    vocab_size: int | None
    max_model_len: int
    device: torch.device  # rank 0's: where the logits to sample are
    dtype: torch.dtype
    #: Why the model runs without prefix caching although it was asked for (None: cached as configured).
    prefix_caching_refusal: str | None = None
    #: ``CausalLM.snapshot_inside_chunk_tokens``: chunks this short may keep a snapshot boundary inside.
    snapshot_inside_chunk_tokens: int = 0


class ModelRunner:
    """One rank's device side (see the module docstring). ``tp`` is the rank in its group."""

    def __init__(self, config: EngineConfig, tp: TensorParallel | None = None) -> None:
        self.tp = tp = tp or TensorParallel()
        loaded = load_model(config, tp)
        self.loaded = loaded
        self.model = model = loaded.model
        self.device = loaded.device
        num_spec = config.speculative.num_tokens
        specs = paged_buffer_specs(model, config.speculative)
        graphs = self.device.type == "cuda" and model.decode_graphs
        self.plan = plan_rank_memory(loaded, config, specs, tp, graphs=graphs and not config.enforce_eager)
        if tp.rank == 0:
            logger.info(self.plan.describe())
        self.buffers = DeviceBuffers(specs, self.plan, self.device)
        self.block_size = self.plan.block_size
        self.max_model_len = loaded.max_model_len
        self.info = ModelInfo(
            loaded.registration.name,
            loaded.folder,
            model.vocab_size or None,
            loaded.max_model_len,
            self.device,
            loaded.dtype,
            model.prefix_caching_refusal,
            model.snapshot_inside_chunk_tokens,
        )
        self.capabilities = ExecutorCapabilities(
            device_embedding=model.embeds_on_device,
            tensor_parallel_size=tp.size,
            max_speculative_tokens=config.speculative.mtp_tokens,
            carried_tokens=True,
        )
        # Request id -> (first position, final hidden states) of its last chunk, for ``propose``.
        self._kept_hidden: dict[str, tuple[int, torch.Tensor]] = {}
        max_blocks = -(-self.max_model_len // self.block_size)
        sched = config.scheduler
        self.decode = DecodeBuffers(sched.max_num_seqs, max_blocks, self.device)
        tokens, segments = prefill_graph_shape(
            model.prefill_graph_tokens,
            config.prefill_graph_max_tokens,
            sched.max_num_batched_tokens,
            sched.max_num_seqs,
        )
        self.prefill_inputs = (  # a verification chunk samples its known token and each draft
            PrefillGraphInputs(tokens, segments, max_blocks, self.device, 1 + num_spec) if tokens else None
        )
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        # The drafter's passes in the prefill graphs' shape, and the hidden states they read.
        self.draft_graphs: PrefillGraphs | None = None
        self._draft_hidden: torch.Tensor | None = None
        # The last batch run on the decode-graph path and its rows' inputs (kept while it is moved on).
        self._graph_rows: DecodeRows | None = None
        self._launch_s = 0.0
        if graphs:
            self.capture_cuda_graphs(eager=config.enforce_eager)

    def check_graph_path(self, *, eager: bool = False) -> None:
        """ExecutorError unless ``capture_cuda_graphs(eager=eager)`` can run here."""
        if (self.device.type != "cuda" and not eager) or not self.model.decode_graphs:
            raise ExecutorError(
                f"decode CUDA graphs need a CUDA device and a model whose decode is graph-safe "
                f"({type(self.model).__name__}.decode_graphs is {self.model.decode_graphs})"
            )

    def check_drafting(self) -> None:
        """ExecutorError unless ``propose`` can run (the model drafts and drafting is on)."""
        if not self.capabilities.max_speculative_tokens:
            raise ExecutorError("this executor does not draft (capabilities.max_speculative_tokens is 0)")

    def capture_cuda_graphs(self, *, eager: bool = False) -> None:
        """Capture CUDA graphs for decode-only steps and, where the model runs them
        (``CausalLM.prefill_graph_tokens``), short prefill-only steps, into one pool (needs a CUDA device
        and ``CausalLM.decode_graphs``); with ``eager`` those steps run the same bucket-padded forwards without
        graphs (on any device: the CPU tests and the CPU benchmark of the host's work take the GPU's
        paths this way)."""
        self.check_graph_path(eager=eager)
        pool = None if eager else torch.cuda.graph_pool_handle()
        graphs = DecodeGraphs(
            self.model,
            self.decode,
            self.buffers.caches,
            self.buffers.states,
            self.tp,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            buckets=graph_buckets(self.decode.max_num_seqs),
            eager=eager,
        )
        graphs.capture(pool)
        self.graphs = graphs
        if self.prefill_inputs is not None:
            prefill = self._prefill_graphs(
                self.prefill_inputs, self.buffers.states, self.buffers.snapshots, eager
            )
            prefill.capture(pool)
            self.prefill_graphs = prefill
            if self.capabilities.max_speculative_tokens:
                self.draft_graphs = self._capture_draft_graphs(pool, eager)
        if not eager:
            # The warm-up forwards' blocks stay cached for the capture stream, where no step runs: give
            # them back, so the steps' transients find the memory their reserve was made from.
            torch.cuda.empty_cache()
        self.capabilities = replace(self.capabilities, cuda_graphs=not eager)

    def _capture_draft_graphs(self, pool, eager: bool) -> PrefillGraphs:
        """The MTP module's passes (``propose``) as prefill graphs of the same shape, each segment
        sampling its last row; a pass's input hidden states are copied into ``_draft_hidden`` first."""
        shape = self.prefill_inputs
        inputs = PrefillGraphInputs(shape.max_tokens, shape.max_segments, shape.max_blocks, self.device)
        probe = self.model.embed(torch.zeros(1, dtype=torch.int64, device=self.device))  # width and dtype
        hidden = self._draft_hidden = probe.new_zeros(shape.max_tokens, probe.shape[-1])
        caches = self.buffers.caches

        def draft_forward(batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
            rows = hidden[: batch.token_ids.shape[0]]
            return self.model.mtp_forward(
                rows,
                batch.token_ids,
                batch,
                caches,
                return_hidden=True,
                logit_rows=inputs.logit_rows_of(rows.shape[0]),
            )

        # The MTP module keeps KV in the caches only: no recurrent state, no snapshots.
        graphs = self._prefill_graphs(inputs, {}, {}, eager, forward=draft_forward)
        graphs.capture(pool)
        return graphs

    def _prefill_graphs(
        self, inputs: PrefillGraphInputs, states, snapshots, eager: bool, forward=None
    ) -> PrefillGraphs:
        """Prefill graphs over ``inputs``' buckets and this rank's caches (the model's forward unless
        ``forward`` is given)."""
        return PrefillGraphs(
            self.model,
            inputs,
            self.buffers.caches,
            states,
            snapshots,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            buckets=prefill_graph_buckets(inputs.max_tokens),
            eager=eager,
            forward=forward,
        )

    @property
    def wait_time_s(self) -> float:
        """Seconds the host spent blocked on the GPU here: waiting for an upload, and in graph launches
        (a graph launched while its previous replay still runs may block until that one is done)."""
        prefill = self.prefill_inputs.wait_time_s if self.prefill_inputs is not None else 0.0
        for graphs in (self.prefill_graphs, self.draft_graphs):
            prefill += graphs.launch_s if graphs is not None else 0.0
        return self.decode.wait_time_s + prefill + self._launch_s

    # ------------------------------------------------------------------------------------------ a step

    @torch.inference_mode()
    def execute(self, batch: ModelBatch) -> ExecutorOutput:
        """Run ``batch``: KV and state of its chunk tokens are written into the buffers; returns the logits
        of the rows that sample (and the full logits of chunks that asked), in chunk order. State snapshots
        are restored before the forward and saved after it (``ModelBatch.state_restores``/``state_saves``),
        or by the forward inside a chunk (``state_checkpoints``)."""
        if batch.state_restores:
            self.buffers.copy_snapshots(batch.state_restores, save=False)
        out = self._execute(batch)
        if batch.state_saves:
            self.buffers.copy_snapshots(batch.state_saves, save=True)
        return out

    def _execute(self, batch: ModelBatch) -> ExecutorOutput:
        self._kept_hidden.clear()
        graph_rows = self._graph_rows
        if batch.moved_on and graph_rows is not None and graph_rows.batch is batch:
            return self._execute_graph(graph_rows, batch.carried_tokens, moved_on=True)  # as last step
        if self.plan.num_state_slots:
            # A request whose first chunk runs (a new one, or a recompute after preemption) starts from zero.
            self.buffers.zero_slots(
                [c.state_slot for c in batch.chunks if c.start == 0 and c.state_slot is not None]
            )
        decodes = [c for c in batch.chunks if len(c.token_ids) == 1]
        prefills = (
            [c for c in batch.chunks if len(c.token_ids) > 1] if len(decodes) < len(batch.chunks) else []
        )
        if self.graphs is not None and not prefills and len(decodes) <= self.graphs.max_batch:
            if all(c.needs_logits and not c.all_logits and not c.keep_hidden for c in decodes):
                self._graph_rows = DecodeRows.of(batch, decodes)
                return self._execute_graph(self._graph_rows, batch.carried_tokens)
        self._graph_rows = None
        if self.prefill_graphs is not None and not decodes and self.prefill_graphs.takes(prefills):
            return self._execute_prefill_graph(batch, prefills)
        return self._execute_eager(batch, prefills, decodes)

    def _execute_prefill_graph(self, batch: ModelBatch, prefills: list[SequenceChunk]) -> ExecutorOutput:
        slots = [c.state_slot or 0 for c in prefills] if self.plan.num_state_slots else None
        logits, hidden = self.prefill_graphs.run(
            prefills, slots, self._checkpoint_pairs(batch.state_checkpoints, prefills)
        )
        row = 0
        for c in prefills:
            if c.keep_hidden:  # a copy: the graph's output is rewritten by its next replay
                self._kept_hidden[c.request_id] = (c.start, hidden[row : row + len(c.token_ids)].clone())
            row += len(c.token_ids)
        return ExecutorOutput(logits=logits)

    def _prepare_decode_rows(
        self,
        rows: DecodeRows,
        carried: torch.Tensor | None,
        pad_to: int | None = None,
        moved_on: bool = False,
    ) -> list[int]:
        carry = rows.carry_from
        if carried is None and self.tp.rank == 0 and carry and max(carry) >= 0:
            raise ExecutorError("a decode chunk carries its token from the last step, but the batch has none")
        return self.decode.prepare(
            rows.owners,
            rows.token_ids,
            rows.positions(),
            rows.block_tables,
            rows.state_slots,
            self.block_size,
            carry_from=carry,
            carried=carried,
            pad_to=pad_to,
            same_rows=moved_on,
        )

    def _execute_graph(
        self, decode_rows: DecodeRows, carried: torch.Tensor | None, moved_on: bool = False
    ) -> ExecutorOutput:
        size = len(decode_rows.chunks)
        # The graph's bucket: its padding rows go up with the batch's (see DecodeGraphs.run). A batch moved on
        # changed only its positions since its rows were last prepared.
        rows = self._prepare_decode_rows(
            decode_rows, carried, pad_to=self.graphs.bucket_for(size), moved_on=moved_on
        )
        t0 = time.perf_counter()
        logits = self.graphs.run(size)
        self._launch_s += time.perf_counter() - t0
        greedy = self.decode.sampled_rows(len(rows))
        if rows == list(range(len(rows))):  # the usual case: rows already in batch order, no gather
            return ExecutorOutput(logits=logits, greedy_tokens=greedy)
        # The row order was uploaded with the decode inputs: no host-to-device copy (and wait) here.
        order = self.decode.row_order[: len(rows)]
        return ExecutorOutput(
            logits=logits.index_select(0, order), greedy_tokens=greedy.index_select(0, order)
        )

    def _prefill_inputs(self, prefills: list[SequenceChunk]) -> tuple[list[int], list[int], list[int], list]:
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        segments = []
        for chunk in prefills:
            n, table = len(chunk.token_ids), chunk.block_table
            ctx = chunk.start + n
            table_t = torch.tensor(table[: -(-ctx // bs)], dtype=torch.int64, device=self.device)
            segments.append(PrefillSegment(len(ids), n, ctx, table_t))
            ids.extend(chunk.token_ids)
            for p in range(chunk.start, ctx):
                pos.append(p)
                slots.append(table[p // bs] * bs + p % bs)
        return ids, pos, slots, segments

    def _forward_batch(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        state_slots: torch.Tensor | None = None,
        checkpoints: StateCheckpoints | None = None,
    ) -> ForwardBatch:
        """The model's batch; a model without device embedding gets its input embeddings made here."""
        return ForwardBatch(
            token_ids,
            positions,
            meta,
            state_slots=state_slots,
            hidden_states=self.model.input_embeddings(token_ids),
            checkpoints=checkpoints,
        )

    @staticmethod
    def _checkpoint_pairs(
        planned: list[tuple[int, int, int, int]], prefills: list[SequenceChunk]
    ) -> list[tuple[int, int, int]] | None:
        """``ModelBatch.state_checkpoints`` (by state slot) as (tokens, snapshot slot, count) per prefill
        segment."""
        if not planned:
            return None
        by_slot = {state: (tokens, snapshot, count) for state, snapshot, tokens, count in planned}
        host = [by_slot.get(c.state_slot, (-1, -1, 0)) for c in prefills]
        if sum(tokens >= 0 for tokens, _, _ in host) != len(planned):
            raise ExecutorError(f"state checkpoints {planned} do not each name a prefill chunk of the step")
        return host

    def _checkpoints(
        self, planned: list[tuple[int, int, int, int]], prefills: list[SequenceChunk]
    ) -> StateCheckpoints | None:
        """The forward's checkpoints (see ``_checkpoint_pairs``), on the device."""
        host = self._checkpoint_pairs(planned, prefills)
        if host is None:
            return None
        # One copy to the device: the tokens, the slots, the counts (each contiguous).
        flat = [t for t, _, _ in host] + [s for _, s, _ in host] + [c for _, _, c in host]
        tokens, slots, counts = torch.tensor(flat, dtype=torch.int64).to(self.device).split(len(host))
        return StateCheckpoints(tokens, slots, counts, host, self.buffers.snapshots)

    def _execute_eager(
        self, batch: ModelBatch, prefills: list[SequenceChunk], decodes: list[SequenceChunk]
    ) -> ExecutorOutput:
        ids, pos, slots, segments = self._prefill_inputs(prefills)
        num_prefill = len(ids)
        dev = self.device
        # Row of every chunk's first token in the device layout (prefill tokens first, then decode rows).
        first_row = {id(chunk): seg.q_start for chunk, seg in zip(prefills, segments, strict=True)}
        meta = AttentionMetadata(
            block_size=self.block_size,
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            prefills=segments,
            num_prefill_tokens=num_prefill,
        )
        token_ids = torch.tensor(ids, dtype=torch.int64, device=dev)
        positions = torch.tensor(pos, dtype=torch.int64, device=dev)
        if decodes:
            rows = self._prepare_decode_rows(DecodeRows.of(batch, decodes), batch.carried_tokens)
            b = len(decodes)
            for chunk, row in zip(decodes, rows, strict=True):
                first_row[id(chunk)] = num_prefill + row
            if self.decode.carries:
                self.tp.broadcast(self.decode.sampled)  # rank 0 sampled the carried tokens
            token_ids = torch.cat([token_ids, self.decode.gather_inputs(b)])
            positions = torch.cat([positions, self.decode.positions[:b]])
            meta.slot_mapping = torch.cat([meta.slot_mapping, self.decode.slot_mapping[:b]])
            meta.num_decodes = b
            meta.decode_block_tables = self.decode.block_tables[:b]
            meta.decode_seq_lens = self.decode.seq_lens[:b]
            meta.max_decode_seq_len = max(c.start for c in decodes) + 1
        state_slots = None
        if self.plan.num_state_slots:
            slots_list = [c.state_slot or 0 for c in prefills]
            state_slots = torch.cat(
                [
                    torch.tensor(slots_list, dtype=torch.int64, device=dev),
                    self.decode.state_slots[: len(decodes)],
                ]
            )
        checkpoints = self._checkpoints(batch.state_checkpoints, prefills)
        hidden = self.model(
            self._forward_batch(token_ids, positions, meta, state_slots, checkpoints),
            self.buffers.caches,
            self.buffers.states,
        )
        sample_rows = [
            first_row[id(c)] + j
            for c in batch.chunks
            for j in range(len(c.token_ids) - c.num_logits, len(c.token_ids))
        ]
        for c in batch.chunks:
            if c.keep_hidden:
                self._kept_hidden[c.request_id] = (
                    c.start,
                    hidden[first_row[id(c)] : first_row[id(c)] + len(c.token_ids)],
                )
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, dtype=torch.int64, device=dev)])
        all_logits = {
            c.request_id: self.model.compute_logits(
                hidden[first_row[id(c)] : first_row[id(c)] + len(c.token_ids)]
            )
            for c in batch.chunks
            if c.all_logits
        }
        return ExecutorOutput(logits=logits, all_logits=all_logits)

    # ---------------------------------------------------------------------------------------- drafting

    def _eager_batch(self, chunks: list[SequenceChunk]) -> tuple[ForwardBatch, list[int]]:
        """A ForwardBatch of ``chunks`` built from scratch (the persistent decode rows are the main step's:
        they are left alone), and the first row of each chunk in its layout (prefills, then decode rows)."""
        bs, dev = self.block_size, self.device
        prefills = [c for c in chunks if len(c.token_ids) > 1]
        decodes = [c for c in chunks if len(c.token_ids) == 1]
        ids, pos, slots, segments = self._prefill_inputs(prefills)
        first_row = {id(c): seg.q_start for c, seg in zip(prefills, segments, strict=True)}
        num_prefill = len(ids)
        for row, c in enumerate(decodes, start=num_prefill):
            first_row[id(c)] = row
            ids.append(c.token_ids[0])
            pos.append(c.start)
            slots.append(c.block_table[c.start // bs] * bs + c.start % bs)
        meta = AttentionMetadata(
            bs, torch.tensor(slots, dtype=torch.int64, device=dev), segments, num_prefill
        )
        if decodes:
            width = max(c.start // bs + 1 for c in decodes)
            tables = torch.zeros(len(decodes), width, dtype=torch.int32)
            for row, c in enumerate(decodes):
                n = c.start // bs + 1
                tables[row, :n] = torch.tensor(c.block_table[:n], dtype=torch.int32)
            meta.num_decodes = len(decodes)
            meta.decode_block_tables = tables.to(dev)
            meta.decode_seq_lens = torch.tensor([c.start + 1 for c in decodes], dtype=torch.int32, device=dev)
            meta.max_decode_seq_len = max(c.start for c in decodes) + 1
        fwd = ForwardBatch(
            torch.tensor(ids, dtype=torch.int64, device=dev),
            torch.tensor(pos, dtype=torch.int64, device=dev),
            meta,
        )
        return fwd, [first_row[id(c)] for c in chunks]

    def _draft_pass(
        self, chunks: list[SequenceChunk], pieces: list[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass of the MTP module (depth 0) over ``chunks``, fed ``pieces`` (their rows' input hidden
        states, chunk by chunk): the draft logits and output hidden states of the last row of each chunk
        with ``num_logits`` 1, in chunk order. Through the draft graphs where they take the pass."""
        sampled = [i for i, c in enumerate(chunks) if c.num_logits]
        graphs = self.draft_graphs
        if graphs is not None and graphs.takes(chunks):
            rows = sum(p.shape[0] for p in pieces)
            torch.cat(pieces, out=self._draft_hidden[:rows])  # straight into the graphs' input
            logits, out = graphs.run(chunks, None, None)
            ends = list(itertools.accumulate(len(c.token_ids) for c in chunks))
            last = torch.tensor([ends[i] - 1 for i in sampled], dtype=torch.int64, device=self.device)
            return logits, out.index_select(0, last)  # a copy: the next replay rewrites ``out``
        hidden = pieces[0] if len(pieces) == 1 else torch.cat(pieces)  # a chained draft's one piece: no copy
        fwd, rows = self._eager_batch(chunks)
        order = torch.tensor(
            [r + j for r, c in zip(rows, chunks, strict=True) for j in range(len(c.token_ids))],
            device=self.device,
        )
        h = torch.empty_like(hidden)
        h[order] = hidden
        last = torch.tensor(
            [rows[i] + len(chunks[i].token_ids) - 1 for i in sampled], dtype=torch.int64, device=self.device
        )
        logits, out = self.model.mtp_forward(
            h, fwd.token_ids, fwd, self.buffers.caches, return_hidden=True, logit_rows=last
        )
        return logits, out[last]

    @torch.inference_mode()
    def propose(self, inputs: list[DraftInput]) -> list[list[int]]:
        """Run the draft module (depth 0, chained for further drafts) over the last step's kept hidden
        states. Pass 1 covers every input's positions ``start .. start + n - 1`` (hidden state at p, token
        at p + 1), which writes the module's cache there and drafts from the last row; each further draft
        is one row at the next position, fed the module's own output hidden state and the previous draft.
        Those chained rows write the cache beyond the accepted positions: garbage that the next step's
        pass 1 overwrites before anything reads it. Every rank drafts the same tokens: the draft logits
        are gathered on every rank before their argmax."""
        self.check_drafting()
        drafts: list[list[int]] = [[] for _ in inputs]
        if not inputs:
            return drafts
        chunks, hidden = [], []
        for inp in inputs:
            start, kept = self._kept_hidden.get(inp.request_id, (-1, None))
            n = len(inp.next_token_ids)
            if start != inp.start or kept is None or not 0 < n <= kept.shape[0]:
                raise ExecutorError(
                    f"no kept hidden states for {n} positions from {inp.start} of {inp.request_id!r}"
                )
            last_position = inp.start + n - 1 + max(inp.num_drafts - 1, 0)
            if last_position // self.block_size >= len(inp.block_table):
                raise ExecutorError(f"{inp.request_id!r} has no page for its draft position {last_position}")
            chunks.append(
                SequenceChunk(
                    inp.request_id,
                    inp.next_token_ids,
                    inp.start,
                    inp.block_table,
                    epoch=inp.epoch,
                    serial=inp.serial,
                    num_logits=int(inp.num_drafts > 0),  # a prompt chunk that drafts nothing fills the cache
                )
            )
            hidden.append(kept[:n])
        self._kept_hidden.clear()
        live = [i for i, inp in enumerate(inputs) if inp.num_drafts > 0]
        logits, h = self._draft_pass(chunks, hidden)
        step = 0
        while live:
            tokens = ops.argmax(logits).tolist()
            for i, token in zip(live, tokens, strict=True):
                drafts[i].append(token)
            step += 1
            keep = [j for j, i in enumerate(live) if inputs[i].num_drafts > step]
            if not keep:
                break
            live = [live[j] for j in keep]
            h = h[torch.tensor(keep, dtype=torch.int64, device=self.device)]
            chunks = [
                SequenceChunk(
                    inputs[i].request_id,
                    [drafts[i][-1]],
                    inputs[i].start + len(inputs[i].next_token_ids) - 1 + step,
                    inputs[i].block_table,
                    epoch=inputs[i].epoch,
                    serial=inputs[i].serial,
                    num_logits=1,
                )
                for i in live
            ]
            logits, h = self._draft_pass(chunks, [h])
        return drafts
