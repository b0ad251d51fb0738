"""The Executor seam: runs a model's forward passes for a step and returns the logits that get sampled.

The engine hands the executor a host-side ``ModelBatch`` (ids and counts, cheap to broadcast to tensor-
parallel ranks later); the executor turns it into device tensors, runs the model, and returns logits in
the batch's order. Capabilities tell the engine what the executor needs and offers.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace

import torch

from pegainfer.buffers import PagedBufferManager
from pegainfer.cuda_graphs import DecodeGraphs, graph_buckets
from pegainfer.decode_buffers import DecodeBuffers
from pegainfer.decode_rows import DecodeRows
from pegainfer.errors import ExecutorError
from pegainfer.layers.attention import AttentionMetadata, PrefillSegment
from pegainfer.model_api import CausalLM, ForwardBatch


@dataclass(frozen=True)
class ExecutorCapabilities:
    #: The model embeds token ids inside its forward; if False the engine must pass ``hidden_states``.
    device_embedding: bool = True
    cuda_graphs: bool = False
    tensor_parallel_size: int = 1
    max_speculative_tokens: int = 0
    #: Decode chunks may take their token from ``ModelBatch.carried_tokens`` (see ``SequenceChunk.carry_from``).
    carried_tokens: bool = False


@dataclass(slots=True)
class SequenceChunk:
    """The tokens one request computes this step."""

    request_id: str
    token_ids: list[int]
    start: int  # position of token_ids[0]
    block_table: list[int]
    state_slot: int | None = None
    needs_logits: bool = False  # the last position is sampled (``num_logits`` 1 unless given)
    all_logits: bool = False  # logits of every position (prompt logprobs)
    epoch: int = 0  # bumps when the request was preempted: its pages are new
    serial: int = -1  # the Request's process-unique serial (request ids can be reused)
    #: How many trailing positions get logits: 1 to sample, ``1 + drafts`` to verify drafts.
    num_logits: int | None = None
    #: Keep this chunk's final hidden states for ``Executor.propose`` (the request drafts).
    keep_hidden: bool = False
    #: A one-token decode chunk whose token is still on the device: index into ``ModelBatch.carried_tokens``.
    carry_from: int = -1

    def __post_init__(self) -> None:
        if self.num_logits is None:
            self.num_logits = int(self.needs_logits)
        self.needs_logits = self.num_logits > 0


@dataclass
class DraftInput:
    """One request's drafter input after a step: the positions ``start .. start + n - 1`` it computed and
    kept (``n = len(next_token_ids)``, the accepted ones only) paired with the token after each."""

    request_id: str
    start: int
    next_token_ids: list[int]  # tokens at positions start + 1 .. start + n; the last one is the newest
    block_table: list[int]  # must hold pages up to position start + n + num_drafts - 3 (the chained drafts)
    num_drafts: int = 0  # 0: only fill the drafter's cache (a prefill chunk that did not sample)
    serial: int = -1  # the request's serial and preemption epoch: its decode-row identity
    epoch: int = 0


@dataclass
class ModelBatch:
    chunks: list[SequenceChunk]
    #: ``[sum of chunk lengths, H]`` in chunk order; required iff the executor lacks device embedding.
    hidden_states: torch.Tensor | None = None
    #: The previous step's sampled tokens, on the device, for chunks with ``carry_from >= 0``.
    carried_tokens: torch.Tensor | None = None
    #: This is the last executed batch (the same object) moved on to the next step: only its chunks'
    #: ``start`` and ``carried_tokens`` changed, so the executor may keep what it drew from the rest.
    moved_on: bool = False


@dataclass
class ExecutorOutput:
    logits: torch.Tensor  # [sum of chunks' num_logits, V]: each chunk's trailing rows, in chunk order
    all_logits: dict[str, torch.Tensor] = field(default_factory=dict)  # request id -> [len, V]
    # logits.argmax(-1), when the step computed it already (the decode graph); read-only for the caller.
    greedy_tokens: torch.Tensor | None = None


class Executor(ABC):
    capabilities: ExecutorCapabilities

    @abstractmethod
    def execute(self, batch: ModelBatch) -> ExecutorOutput:
        """Run one step's forward; KV and state for the chunk tokens are written into the buffers."""

    def embed(self, token_ids: list[int]) -> torch.Tensor:
        """Input embeddings for executors without device embedding (the engine calls it for them)."""
        raise ExecutorError("this executor embeds on the device and does not take hidden states")

    def propose(self, inputs: list[DraftInput]) -> list[list[int]]:
        """Greedy drafts (``num_drafts`` each) from the model's draft layers, after the step whose chunks
        had ``keep_hidden``; also fills the draft layers' caches at the inputs' positions."""
        raise ExecutorError("this executor does not draft (capabilities.max_speculative_tokens is 0)")

    @property
    def wait_time_s(self) -> float:
        """Seconds the host spent blocked on the GPU inside the executor since start (0 if not tracked)."""
        return 0.0

    def shutdown(self) -> None:  # noqa: B027 - optional hook: a local executor has nothing to release
        """Release workers and device memory."""


class LocalExecutor(Executor):
    """Single-process executor: one model on one device, decode rows through persistent buffers."""

    def __init__(
        self,
        model: CausalLM,
        buffers: PagedBufferManager,
        *,
        max_num_seqs: int,
        max_model_len: int,
        num_speculative_tokens: int = 0,
    ) -> None:
        self.model = model
        self.buffers = buffers
        self.device = buffers.device
        self.block_size = buffers.block_size
        if num_speculative_tokens and not getattr(model, "num_mtp_layers", 0):
            raise ExecutorError(f"{type(model).__name__} has no draft (MTP) layers to speculate with")
        self.capabilities = ExecutorCapabilities(
            device_embedding=model.embeds_on_device,
            max_speculative_tokens=num_speculative_tokens,
            carried_tokens=model.embeds_on_device,
        )
        # Request id -> (first position, final hidden states) of its last chunk, for ``propose``.
        self._kept_hidden: dict[str, tuple[int, torch.Tensor]] = {}
        self.decode = DecodeBuffers(max_num_seqs, -(-max_model_len // self.block_size), self.device)
        self.max_model_len = max_model_len
        self.graphs: DecodeGraphs | None = None
        # The last batch run on the decode-graph path and its rows' inputs (kept while it is moved on).
        self._graph_rows: DecodeRows | None = None
        self._launch_s = 0.0

    def capture_decode_graphs(self, *, eager: bool = False) -> None:
        """Capture CUDA graphs for decode-only steps (needs a CUDA device and device embedding); with
        ``eager`` decode-only steps run the same bucket-padded forward without graphs (on any device: the
        CPU benchmark of the host's work takes the GPU's decode path this way)."""
        if (self.device.type != "cuda" and not eager) or not self.capabilities.device_embedding:
            raise ExecutorError("decode CUDA graphs need a CUDA device and a model that embeds on the device")
        graphs = DecodeGraphs(
            self.model,
            self.decode,
            self.buffers.caches,
            self.buffers.states,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            buckets=graph_buckets(self.decode.max_num_seqs),
            eager=eager,
        )
        graphs.capture()
        self.graphs = graphs
        self.capabilities = replace(self.capabilities, cuda_graphs=not eager)

    def embed(self, token_ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return self.model.embed(torch.tensor(token_ids, dtype=torch.int64, device=self.device))

    def _prepare_decode_rows(
        self,
        rows: DecodeRows,
        carried: torch.Tensor | None,
        pad_to: int | None = None,
        moved_on: bool = False,
    ) -> list[int]:
        carry = rows.carry_from
        if carried is None and carry and max(carry) >= 0:
            raise ExecutorError("a decode chunk carries its token from the last step, but the batch has none")
        return self.decode.prepare(
            rows.owners,
            rows.token_ids,
            rows.positions(),
            rows.block_tables,
            rows.state_slots,
            self.block_size,
            carry_from=carry if carried is not None else None,
            carried=carried,
            pad_to=pad_to,
            same_rows=moved_on,
        )

    @property
    def wait_time_s(self) -> float:
        """Seconds the host spent blocked on the GPU here: waiting for an upload, and in graph launches
        (a graph launched while its previous replay still runs may block until that one is done)."""
        return self.decode.wait_time_s + self._launch_s

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

    def _reorder_hidden_states(self, batch: ModelBatch, first_row: dict[int, int]) -> torch.Tensor:
        """The batch's hidden states come in chunk order; the device layout is prefills, then decode rows."""
        order: list[int] = [0] * batch.hidden_states.shape[0]
        cursor = 0
        for chunk in batch.chunks:
            row = first_row[id(chunk)]
            for j in range(len(chunk.token_ids)):
                order[row + j] = cursor + j
            cursor += len(chunk.token_ids)
        index = torch.tensor(order, dtype=torch.int64, device=batch.hidden_states.device)
        return batch.hidden_states[index].to(self.device)

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

    @torch.inference_mode()
    def execute(self, batch: ModelBatch) -> ExecutorOutput:
        if not self.capabilities.device_embedding and batch.hidden_states is None:
            raise ExecutorError(
                f"{type(self.model).__name__} does not embed on the device: the batch must carry hidden_states"
            )
        self._kept_hidden.clear()
        graph_rows = self._graph_rows
        if batch.moved_on and graph_rows is not None and graph_rows.batch is batch:
            return self._execute_graph(graph_rows, batch.carried_tokens, moved_on=True)  # as last step
        decodes = [c for c in batch.chunks if len(c.token_ids) == 1]
        prefills = (
            [c for c in batch.chunks if len(c.token_ids) > 1] if len(decodes) < len(batch.chunks) else []
        )
        if self.graphs is not None and not prefills and len(decodes) <= self.graphs.max_batch:
            if all(c.needs_logits and not c.all_logits and not c.keep_hidden for c in decodes):
                self._graph_rows = DecodeRows.of(batch, decodes)
                return self._execute_graph(self._graph_rows, batch.carried_tokens)
        self._graph_rows = None
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
            token_ids = torch.cat([token_ids, self.decode.gather_inputs(b)])
            positions = torch.cat([positions, self.decode.positions[:b]])
            meta.slot_mapping = torch.cat([meta.slot_mapping, self.decode.slot_mapping[:b]])
            meta.num_decodes = b
            meta.decode_block_tables = self.decode.block_tables[:b]
            meta.decode_seq_lens = self.decode.seq_lens[:b]
            meta.max_decode_seq_len = max(c.start for c in decodes) + 1
        hidden_in = None
        if not self.capabilities.device_embedding:
            hidden_in = self._reorder_hidden_states(batch, first_row)
        state_slots = None
        if self.buffers.plan.num_state_slots:
            slots_list = [c.state_slot or 0 for c in prefills]
            state_slots = torch.cat(
                [
                    torch.tensor(slots_list, dtype=torch.int64, device=dev),
                    self.decode.state_slots[: len(decodes)],
                ]
            )
        fwd = ForwardBatch(token_ids, positions, meta, state_slots=state_slots, hidden_states=hidden_in)
        hidden = self.model(fwd, self.buffers.caches, self.buffers.states)
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

    @torch.inference_mode()
    def propose(self, inputs: list[DraftInput]) -> list[list[int]]:
        """Run the draft module (depth 0, chained for further drafts) over the last step's kept hidden
        states. Pass 1 covers every input's positions ``start .. start + n - 1`` (hidden state at p, token
        at p + 1), which writes the module's cache there and drafts from the last row; each further draft
        is one row at the next position, fed the module's own output hidden state and the previous draft.
        Those chained rows write the cache beyond the accepted positions: garbage that the next step's
        pass 1 overwrites before anything reads it."""
        if not self.capabilities.max_speculative_tokens:
            return super().propose(inputs)
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
                )
            )
            hidden.append(kept[:n])
        self._kept_hidden.clear()
        fwd, rows = self._eager_batch(chunks)
        order = torch.tensor(
            [r + j for r, c in zip(rows, chunks, strict=True) for j in range(len(c.token_ids))],
            device=self.device,
        )
        h = torch.empty(len(order), hidden[0].shape[1], dtype=hidden[0].dtype, device=self.device)
        h[order] = torch.cat(hidden)
        live = [i for i, inp in enumerate(inputs) if inp.num_drafts > 0]
        last = torch.tensor(
            [rows[i] + len(chunks[i].token_ids) - 1 for i in live], dtype=torch.int64, device=self.device
        )
        caches = self.buffers.caches
        logits, h = self.model.mtp_forward(h, fwd.token_ids, fwd, caches, return_hidden=True, logit_rows=last)
        h = h[last]
        step = 0
        while live:
            tokens = logits.argmax(dim=-1).tolist()
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
                )
                for i in live
            ]
            fwd, _ = self._eager_batch(chunks)
            logits, h = self.model.mtp_forward(h, fwd.token_ids, fwd, caches, return_hidden=True)
        return drafts
