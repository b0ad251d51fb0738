"""The decode batch kept from one async step to the next.

In the steady state of async decoding every step plans the requests the last step decoded, in the same
order, one token each: the token is the one the last step sampled, still on the device in the same row,
so each request's chunk differs from last step's only in its position. The engine then moves last step's
chunks on instead of building one per request. A request that finishes, is aborted or preempted, or one
that arrives changes the planned requests, and the batch is built anew.
"""

from __future__ import annotations

import torch

from pegainfer.engine.request import Request
from pegainfer.executor.model_batch import ModelBatch
from pegainfer.scheduling.scheduler import ScheduledRequest


class PersistentDecodeBatch:
    """Last step's batch, while it is a pure carried decode batch (see the module docstring).

    Moving it on relies on what stays fixed while a request keeps running in one preemption epoch: its
    request id, serial and state slot, and its block table (the buffer manager's live list, extended in
    place); and on no step having planned in between, which the executed-step count proves. Carried
    chunks mean the model embeds on the device: the batch has no host hidden states to redo."""

    def __init__(self) -> None:
        self._batch: ModelBatch | None = None
        self._requests: list[Request] = []
        self._step = -1

    def reuse(self, scheduled: list[ScheduledRequest], carried: torch.Tensor, step: int) -> ModelBatch | None:
        """Last step's batch moved on to ``scheduled``'s positions, carrying from ``carried`` (the last
        step's samples), when it ran as step ``step - 1`` and ``scheduled`` plans the same requests in the
        same order; else None."""
        batch = self._batch
        if batch is None or step != self._step + 1:
            return None
        if [item.request for item in scheduled] != self._requests:  # identity: Request has no __eq__
            return None
        for item, chunk in zip(scheduled, batch.chunks, strict=True):
            chunk.start = item.start
        batch.carried_tokens = carried
        batch.moved_on = True
        self._step = step
        return batch

    def remember(self, scheduled: list[ScheduledRequest], batch: ModelBatch, step: int) -> None:
        """Keep ``batch``, just built for ``scheduled`` as step ``step``, when each of its chunks decodes one
        token carried from its own row of the last step's samples and samples the next: the next step
        plans the same requests at the next positions, carried from the same rows. Otherwise forget."""
        self._batch = None
        for row, chunk in enumerate(batch.chunks):
            # (A carried chunk is one token: the engine builds no other.)
            if chunk.carry_from != row or chunk.num_logits != 1 or chunk.all_logits or chunk.keep_hidden:
                return
        self._batch, self._requests, self._step = batch, [item.request for item in scheduled], step
