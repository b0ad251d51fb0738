"""From a step's plan to the executor's ModelBatch: each scheduled request's chunk, in the plan's order.

A chunk carries what its rank runners need and nothing else: the tokens (or, for a decode row
scheduled ahead of the last step's read-back, the row of the last step's samples to take its token
from), the first position, the request's block table and state slot, and how many trailing rows
sample. In the steady state of async decoding last step's batch is moved on instead
(``PersistentDecodeBatch``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pegainfer.engine.persistent_batch import PersistentDecodeBatch
from pegainfer.engine.request import PENDING_TOKEN, Request
from pegainfer.executor.model_batch import ModelBatch, SequenceChunk
from pegainfer.memory.buffer_manager import BufferManager
from pegainfer.sampling.sampler import DeviceSample
from pegainfer.scheduling.scheduler import ScheduledRequest, SchedulerOutput


@dataclass
class PendingStep:
    """A launched step whose sampled tokens are still on the device (async scheduling)."""

    items: list[ScheduledRequest]  # the sampling items, in the sampled rows' order
    sample: DeviceSample
    row_of: dict[int, int]  # request serial -> its row in ``sample.tokens``


class BatchBuilder:
    """``wants_prompt_logits(request, start)``: whether a chunk needs every position's logits;
    ``keeps_hidden(request)``: whether the request drafts (its chunk keeps its hidden states)."""

    def __init__(
        self,
        buffers: BufferManager,
        wants_prompt_logits: Callable[[Request, int], bool],
        keeps_hidden: Callable[[Request], bool] | None,
    ) -> None:
        self.buffers = buffers
        self.wants_prompt_logits = wants_prompt_logits
        self.keeps_hidden = keeps_hidden
        self._decode_batch = PersistentDecodeBatch()

    def build(self, plan: SchedulerOutput, pending: PendingStep | None, step: int) -> ModelBatch:
        """Step ``step``'s batch: last step's moved on in the steady state of async decoding (see
        PersistentDecodeBatch), else a chunk built for every planned request."""
        batch = None
        if pending is not None:
            batch = self._decode_batch.reuse(plan.scheduled, pending.sample.tokens, step)
        if batch is None:
            batch = self._new_batch(plan, pending)
            self._decode_batch.remember(plan.scheduled, batch, step)
        # Prefix caching of recurrent state: this step's snapshot restores and saves (usually none).
        batch.state_restores, batch.state_saves, batch.state_checkpoints = self.buffers.take_state_copies()
        return batch

    def _new_batch(self, plan: SchedulerOutput, pending: PendingStep | None) -> ModelBatch:
        chunks = []
        block_table, state_slot = self.buffers.block_table, self.buffers.state_slot
        keeps_hidden = self.keeps_hidden
        for item in plan.scheduled:
            req = item.request
            spec = item.spec_token_ids
            start = item.start
            end = start + item.num_new_tokens - len(spec)
            all_ids = req.all_token_ids
            carry_from = -1
            if all_ids[end - 1] == PENDING_TOKEN:
                # Scheduled ahead: the token is the last step's, still on the device (a decode chunk only).
                if end - start != 1 or pending is None:
                    raise RuntimeError(f"{req.request_id}: a pending token in a {end - start}-token chunk")
                carry_from = pending.row_of[req.serial]
            rid = req.request_id
            all_logits = req.sampling_params.prompt_logprobs is not None and self.wants_prompt_logits(
                req, start
            )
            chunks.append(
                SequenceChunk(  # positional (cheaper for a row of every step), in the field order:
                    rid,  # request_id
                    all_ids[start:end] + spec if spec else all_ids[start:end],  # token_ids
                    start,
                    block_table(rid),
                    state_slot(rid),
                    False,  # needs_logits: num_logits decides
                    all_logits,
                    req.num_preemptions,  # epoch
                    req.serial,
                    (1 + len(spec)) if item.samples else 0,  # num_logits
                    keeps_hidden is not None and keeps_hidden(req),  # keep_hidden
                    carry_from,
                )
            )
        batch = ModelBatch(chunks)
        if pending is not None:
            batch.carried_tokens = pending.sample.tokens
        return batch
