"""Speculative decoding: verify, roll back, propose, with drafts from the model's own draft layers
(DeepSeek's and Qwen3.5's MTP, ``method: mtp``) or from the request's own tokens (``method: ngram``).

One step of a drafting request computes its last token ``t_C`` (position C) and its drafts
``d_0 .. d_{k-1}`` (positions C+1 .. C+k) in one forward, with logits at all 1 + k positions. Verification
samples those rows in order, as the sampler would have one step at a time: row i gives the token after
position C+i; it is appended (through the engine's stop checks), and the next row is looked at only if the
token equals ``d_i``. So a request appends ``accepted + 1`` tokens: the accepted drafts and the first
mismatch (or, all accepted, the bonus token of the last row). Greedy output is the same token for token as
without drafts, penalties, ``min_tokens`` and logprobs included (the sampler sees each appended token).
Rows past a stop are never sampled. The computed count becomes ``C + 1 + accepted``; the KV of rejected
positions lies beyond it and is overwritten by later steps (its pages stay allocated).

Only greedy requests draft: a sampled request decodes one token per step as before.

Prompt lookup (``prompt_lookup.PromptLookup``) needs nothing from the device: after verification, the
tokens that followed the latest earlier occurrence of the request's last n tokens are its drafts.

Drafting with MTP layers (``Executor.propose``) runs after verification, when the token after the last
computed position is known. The draft module's cache must hold an entry for every position the drafts attend to, so for
every position p the main model computed and kept (prompt chunks, the last token, accepted drafts) the
module is run once with the main model's hidden state at p and the token at p + 1 — the entries for a
request's positions 0 .. C-1 are written across its steps, each exactly once and always with final
tokens. The last such row drafts ``d_0``; further drafts chain one row each at positions C, C+1, ...
(the module's own output hidden state and the previous draft), writing entries there that the next
step's rows overwrite before anything reads them. Those chained positions need pages: they are taken
here before ``propose`` (the next step's verification needs them anyway), and fewer drafts are made when
the pool is short.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from pegainfer.config.schema import SpeculativeConfig
from pegainfer.engine.outputs import PositionLogprobs
from pegainfer.engine.request import Request, RequestStatus
from pegainfer.errors import ConfigError
from pegainfer.executor.model_batch import DraftInput
from pegainfer.memory.buffer_manager import BufferManager
from pegainfer.memory.buffer_specs import BufferSpec, has_recurrent_state
from pegainfer.sampling.sampler import Sampler
from pegainfer.scheduling.prompt_lookup import PromptLookup
from pegainfer.scheduling.scheduler import ScheduledRequest, Scheduler, SchedulerOutput

#: ``append(request, token, logprobs)`` appends one token through the stop checks; False once finished.
if TYPE_CHECKING:
    from pegainfer.executor.executor import Executor
    from pegainfer.model.model_api import CausalLM

AppendToken = Callable[[Request, int, PositionLogprobs | None], bool]


def paged_buffer_specs(model: CausalLM, speculative: SpeculativeConfig) -> list[BufferSpec]:
    """What a rank's pages hold: the model's caches and, drafting with its MTP layers, theirs (on the same
    block table as the main layers). A ConfigError when the model cannot verify drafts."""
    check_roll_back(model, speculative.num_tokens)
    return [*model.buffer_specs(), *draft_buffer_specs(model, speculative.mtp_tokens)]


def check_roll_back(model: CausalLM, num_tokens: int) -> None:
    """A ConfigError when ``model`` keeps recurrent state it cannot roll back past rejected drafts."""
    if (
        num_tokens > 0
        and has_recurrent_state(model.buffer_specs())
        and not model.snapshot_inside_chunk_tokens
    ):
        raise ConfigError(
            f"speculative.num_tokens={num_tokens}: {type(model).__name__} keeps recurrent state but its "
            "forward saves no state inside a chunk (snapshot_inside_chunk_tokens), so rejected drafts "
            "cannot be rolled back; set speculative.num_tokens=0"
        )


def draft_buffer_specs(model: CausalLM, num_tokens: int) -> list[BufferSpec]:
    """The caches MTP drafting adds to the model's (none when off); a ConfigError when the model has no
    draft layers.

    Only the first draft module runs (chained for further drafts), so only its caches (the specs of the
    first spec's layer: its main cache and any named ones) are allocated.
    """
    if num_tokens <= 0:
        return []
    if model.num_mtp_layers <= 0:
        raise ConfigError(
            f"speculative.num_tokens={num_tokens} needs a model with draft (MTP) layers, and "
            f"{type(model).__name__} has none loaded (a checkpoint without them); set "
            "speculative.method=ngram (prompt lookup) or speculative.num_tokens=0"
        )
    specs = model.mtp_buffer_specs()
    return [spec for spec in specs if spec.layer_index == specs[0].layer_index] if specs else []


def sample_and_verify(
    sampler: Sampler, logits: torch.Tensor, items: list[ScheduledRequest], append: AppendToken
) -> list[int]:
    """Sample every item's rows (``1 + len(item.spec_token_ids)`` consecutive rows of ``logits`` each, in
    order), append the tokens, and return how many drafts of each item were accepted.

    Round r samples row r of every item still verifying, in one sampler call; without drafts this is one
    call over all rows, exactly the plain decoding step. Where no request's choice depends on the tokens
    appended before it (``Sampler.rows_independent``: greedy, no penalties, no ``min_tokens``), every row
    is sampled in that one call (one read from the device, not one a round) and the rounds only append.
    """
    offsets, total = [], 0
    for item in items:
        offsets.append(total)
        total += 1 + len(item.spec_token_ids)
    if logits.shape[0] != total:
        raise ValueError(
            f"expected {total} logits rows for {len(items)} sampling requests, got {logits.shape[0]}"
        )
    requests = [item.request for item in items]
    whole = None
    if total > len(items) and sampler.rows_independent(requests, [item.spec_token_ids for item in items]):
        whole = sampler(logits, [item.request for item in items for _ in range(1 + len(item.spec_token_ids))])
    accepted = [0] * len(items)
    active = list(range(len(items)))
    depth = 0
    while active:
        rows = [offsets[i] + depth for i in active]
        if whole is None:
            block = logits if len(rows) == total else logits[torch.tensor(rows, device=logits.device)]
            out = sampler(block, [requests[i] for i in active])
            tokens, logprobs = out.token_ids, out.logprobs
        else:
            tokens, logprobs = [whole.token_ids[r] for r in rows], [whole.logprobs[r] for r in rows]
        still = []
        for j, i in enumerate(active):
            token = tokens[j]
            alive = append(items[i].request, token, logprobs[j])
            spec = items[i].spec_token_ids
            if depth < len(spec) and token == spec[depth]:
                accepted[i] += 1  # a draft that stops the request still counts as accepted
                if alive:
                    still.append(i)
        active = still
        depth += 1
    return accepted


class SpeculativeDecoder:
    """The engine's drafting bookkeeping: which requests draft, how many drafts, counts and rollback.
    ``lookup``: (n_min, n_max) of prompt lookup, which then makes the drafts instead of the executor."""

    def __init__(
        self,
        num_tokens: int,
        executor: Executor,
        buffers: BufferManager,
        scheduler: Scheduler,
        max_model_len: int,
        lookup: tuple[int, int] | None = None,
    ) -> None:
        self.num_tokens = num_tokens
        self.executor = executor
        self.buffers = buffers
        self.scheduler = scheduler
        self.max_model_len = max_model_len
        self.lookup = lookup
        # A request's lookup array lives as long as the request does.
        self._lookups: weakref.WeakKeyDictionary[Request, PromptLookup] = weakref.WeakKeyDictionary()

    @classmethod
    def from_config(
        cls,
        config: SpeculativeConfig,
        executor: Executor,
        buffers: BufferManager,
        scheduler: Scheduler,
        max_model_len: int,
    ) -> SpeculativeDecoder | None:
        """The decoder ``config`` asks for; None when speculation is off."""
        if not config.num_tokens:
            return None
        lookup = (config.prompt_lookup_min, config.prompt_lookup_max) if config.method == "ngram" else None
        return cls(config.num_tokens, executor, buffers, scheduler, max_model_len, lookup)

    @staticmethod
    def drafts_for(request: Request) -> bool:
        """Whether ``request`` drafts (and so keeps its hidden states): greedy requests only."""
        return request.sampling_params.greedy

    def _num_drafts(self, request: Request) -> int:
        """Up to ``num_tokens``, never more than the request can still emit (the last token is the bonus)
        nor positions past ``max_model_len``."""
        left = request.sampling_params.max_tokens - request.num_output_tokens - 1
        return max(0, min(self.num_tokens, left, self.max_model_len - request.num_tokens))

    def after_step(
        self, plan: SchedulerOutput, items: list[ScheduledRequest], accepted: list[int], stats: dict[str, int]
    ) -> None:
        """Count and commit the verified drafts of ``items`` (the sampling ones, in ``accepted``'s order),
        then draft for every request of the step that keeps going."""
        for item, n in zip(items, accepted, strict=True):
            if item.spec_token_ids:
                request = item.request
                request.num_draft_tokens += len(item.spec_token_ids)
                request.num_accepted_tokens += n
                stats["spec_draft_tokens"] += len(item.spec_token_ids)
                stats["spec_accepted_tokens"] += n
                self.scheduler.accept_spec_tokens(item, n)
                if n < len(item.spec_token_ids):
                    self.buffers.roll_back_state(request, n)  # recurrent state: back to the accepted tokens
        inputs: list[DraftInput] = []
        targets: list[Request] = []
        for item in plan.scheduled:
            request = item.request
            request.spec_token_ids = []
            if request.status is not RequestStatus.RUNNING or not self.drafts_for(request):
                continue
            drafts = self._num_drafts(request) if item.samples else 0
            if self.lookup is not None:
                if drafts:
                    lookup = self._lookups.get(request)
                    if lookup is None:
                        lookup = self._lookups[request] = PromptLookup(*self.lookup)
                    request.spec_token_ids = lookup.drafts(request.all_token_ids, drafts)
                continue
            computed = request.num_computed_tokens
            if drafts > 1 and not self.buffers.allocate_slots(request, drafts - 1):
                capacity = len(self.buffers.block_table(request.request_id)) * self.buffers.block_size
                drafts = min(drafts, capacity - computed + 1)
            inputs.append(
                DraftInput(
                    request.request_id,
                    item.start,
                    request.all_token_ids[item.start + 1 : computed + 1],
                    self.buffers.block_table(request.request_id),
                    drafts,
                    serial=request.serial,
                    epoch=request.num_preemptions,
                )
            )
            targets.append(request)
        if inputs:
            for request, drafts in zip(targets, self.executor.propose(inputs), strict=True):
                request.spec_token_ids = drafts
