"""The data an executor takes and gives back each step: plain host-side values, cheap to send to ranks.

The engine hands the executor a ``ModelBatch`` (ids and counts: each request's chunk of tokens, its
first position, its block table and state slot, how many trailing rows it samples); the executor's
runners turn it into device tensors and return ``ExecutorOutput`` logits in the batch's order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class ExecutorCapabilities:
    #: The model embeds token ids inside its forward; if False its runner embeds them before the forward.
    device_embedding: bool = True
    cuda_graphs: bool = False
    tensor_parallel_size: int = 1
    #: Draft tokens a step ``Executor.propose`` makes from the model's draft (MTP) layers; 0: it makes none.
    max_speculative_tokens: int = 0
    #: Decode chunks may take their token from ``ModelBatch.carried_tokens`` (see ``SequenceChunk.carry_from``).
    carried_tokens: bool = False


@dataclass(slots=True)
class SequenceChunk:
    """The tokens one request computes this step."""

    request_id: str
    token_ids: list[int]
    start: int  # position of token_ids[0]
    #: The request's page ids in token order (at least up to the chunk's last position). Within one
    #: preemption epoch a later chunk's table extends an earlier one's: it only ever grows.
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
    #: The previous step's sampled tokens, on rank 0's device, for chunks with ``carry_from >= 0``.
    carried_tokens: torch.Tensor | None = None
    #: This is the last executed batch (the same object) moved on to the next step: only its chunks'
    #: ``start`` and ``carried_tokens`` changed, so the executor may keep what it drew from the rest.
    moved_on: bool = False
    #: Recurrent-state snapshots, (state slot, snapshot slot) pairs: snapshots copied into the slots before
    #: the forward (a request resuming from a cached prefix, or rolling rejected drafts back), and slots
    #: copied into snapshots after it (chunks that end at a caching boundary). Set for every step, the
    #: moved-on batch's included.
    state_restores: list[tuple[int, int]] = field(default_factory=list)
    state_saves: list[tuple[int, int]] = field(default_factory=list)
    #: (state slot, snapshot slot, tokens, count): the state of the chunk owning that slot after its first
    #: ``tokens + j`` tokens goes into snapshot ``snapshot slot + j`` for ``j < count``, saved by the
    #: forward itself (``CausalLM.snapshot_inside_chunk_tokens``): prefix caching's page boundary inside a
    #: chunk (count 1), speculative decoding's roll-back points inside a verification chunk.
    state_checkpoints: list[tuple[int, int, int, int]] = field(default_factory=list)


@dataclass
class ExecutorOutput:
    # [sum of chunks' num_logits, V]: each chunk's trailing rows, in chunk order. A decode graph's logits are
    # its static output, overwritten by the next step: clone what must outlive it.
    logits: torch.Tensor
    all_logits: dict[str, torch.Tensor] = field(default_factory=dict)  # request id -> [len, V]
    # logits.argmax(-1), when the step computed it already (the decode graph); read-only for the caller.
    greedy_tokens: torch.Tensor | None = None
