"""The engine's host bookkeeping after a step: append tokens, detokenize, stop checks, outputs.

``OutputProcessor`` holds the live user requests (``RequestGroup``: the ``n`` sequences of one request)
and their sequences by id. Each sampled token goes through one pass: logprobs, incremental
detokenizing, the stop and length checks; a finished sequence is ended through the scheduler (which
frees its pages). A sequence whose processing raises fails alone, with an error; the others go on.
"""

from __future__ import annotations

import logging

import torch

from pegainfer.engine.outputs import PositionLogprobs, RequestOutput
from pegainfer.engine.request import FINISHED_STATUSES, Request, RequestStatus
from pegainfer.engine.request_group import RequestGroup, SequenceState
from pegainfer.sampling.sampler import SamplerOutput, compute_prompt_logprobs
from pegainfer.sampling.sampling_params import RequestOutputKind
from pegainfer.sampling.structured import consume
from pegainfer.scheduling.scheduler import ScheduledRequest, Scheduler
from pegainfer.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

#: ``LLMEngine.stats`` counters (the spec_* ones: draft tokens verified and accepted, all requests).
STAT_KEYS = ("prompt_tokens", "generation_tokens", "steps", "spec_draft_tokens", "spec_accepted_tokens")

#: (sequence, its newest token, that token's logprobs if asked for)
Appended = tuple[SequenceState, int, PositionLogprobs | None]


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, scheduler: Scheduler, stats: dict[str, int]) -> None:
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.stats = stats
        self.groups: dict[str, RequestGroup] = {}
        self.sequences: dict[str, SequenceState] = {}

    # -------------------------------------------------------------------------------------- requests

    def id_in_use(self, request_id: str, child_ids: list[str]) -> bool:
        """A parent id and its n child ids share one namespace with every live sequence: "a" with n=2
        creates "a#1", which must not silently replace a live request named "a#1" (or vice versa)."""
        groups, sequences = self.groups, self.sequences
        return request_id in groups or any(cid in sequences or cid in groups for cid in child_ids)

    def add(self, group: RequestGroup) -> None:
        self.groups[group.request_id] = group
        for seq in group.sequences:
            self.sequences[seq.request.request_id] = seq

    def remove(self, request_id: str) -> RequestGroup | None:
        """Forget the group ``request_id`` (its sequences too); returns it."""
        group = self.groups.pop(request_id, None)
        if group is not None:
            for seq in group.sequences:
                self.sequences.pop(seq.request.request_id, None)
        return group

    def group_of(self, request: Request) -> RequestGroup:
        rid = request.request_id
        group = self.groups.get(rid)
        return group if group is not None else self.groups[rid.rpartition("#")[0]]

    def wants_prompt_logits(self, request: Request, start: int) -> bool:
        """Whether a chunk of ``request`` starting at ``start`` needs the logits of every position: its
        group asked for prompt logprobs and has not got them all."""
        if request.sampling_params.prompt_logprobs is None:
            return False
        have = self.group_of(request).prompt_logprobs
        return len(have) < request.num_prompt_tokens and start < request.num_prompt_tokens

    # ---------------------------------------------------------------------------------------- tokens

    def append(self, request: Request, token: int, logprobs: PositionLogprobs | None) -> bool:
        """Append one sampled token; False once the request finished (stopped, length, or failed)."""
        try:
            seq = self.sequences[request.request_id]
            seq.request.append_output_token(token)
            self.after_tokens([(seq, token, logprobs)])
        except Exception as exc:
            self.fail(request, exc)
        return not request.is_finished

    def resolve(
        self, items: list[ScheduledRequest], sampled: SamplerOutput, row_of: dict[int, int]
    ) -> list[ScheduledRequest]:
        """Settle the pending tokens of an async step whose ``sampled`` rows belong to ``items`` (only the
        requests in ``row_of`` took a pending token); returns the items whose token was appended."""
        resolved = []
        done: list[Appended] = []
        sequences = self.sequences
        token_ids, logprobs = sampled.token_ids, sampled.logprobs
        for row, item in enumerate(items):
            request = item.request
            if request.serial not in row_of or request.status in FINISHED_STATUSES:
                continue  # aborted since, or finished before this row was sampled
            seq = sequences.get(request.request_id)
            if seq is None or seq.request is not request:
                continue
            token = token_ids[row]
            request.resolve_pending_token(token)
            done.append((seq, token, logprobs[row]))
            resolved.append(item)
        self.after_tokens(done)
        return resolved

    def after_tokens(self, done: list[Appended]) -> None:
        """Account each sequence's newest token: logprobs, detokenizing, stop and length checks (one pass:
        this runs for every request of every step). A request that fails here is finished with an error;
        the others go on."""
        self.stats["generation_tokens"] += len(done)
        for seq, token, logprobs in done:
            request = seq.request
            if logprobs is not None and seq.logprobs is not None:
                try:
                    seq.logprobs.append(self._decode_logprobs(logprobs))
                    seq.cumulative_logprob += logprobs[token].logprob
                except Exception as exc:
                    self.fail(request, exc)
            num_tokens = len(request.all_token_ids)
            # Before min_tokens no stop condition applies (the sampler already bans EOS and stop ids), stop
            # strings included, as in vLLM.
            check = num_tokens >= request.min_num_tokens
            stop_token = check and token in request.stop_ids
            # A stop token's text (EOS, stop_token_ids) is no part of the output unless
            # include_stop_str_in_output asks for it, as vLLM has it (skip_special_tokens=False included).
            keeps_text = not stop_token or request.sampling_params.include_stop_str_in_output
            try:  # a failed request's text still takes its last token
                stop_str = seq.detokenizer.update_one(token, check) if keeps_text else None
            except Exception as exc:
                if request.status not in FINISHED_STATUSES:
                    self.fail(request, exc)
                continue
            if request.status in FINISHED_STATUSES:
                continue  # failed above
            status = None
            if stop_str is not None:
                status, request.stop_reason = RequestStatus.FINISHED_STOPPED, stop_str
            elif stop_token:
                status = RequestStatus.FINISHED_STOPPED
                if token in request.sampling_params.stop_token_ids:  # EOS leaves no stop reason
                    request.stop_reason = token
            elif num_tokens >= request.max_num_tokens:
                status = RequestStatus.FINISHED_LENGTH
            if request.grammar is not None and status is None:
                try:
                    if consume(request.grammar, token):  # the structured output is complete
                        status = RequestStatus.FINISHED_STOPPED
                except Exception as exc:
                    self.fail(request, exc)
                    continue
            deferred = request.deferred_grammar
            if deferred is not None and token == deferred[0]:  # e.g. </think>: the grammar starts next
                request.grammar, request.deferred_grammar = deferred[1], None
            if status is not None:
                try:
                    seq.detokenizer.finish()
                except Exception as exc:
                    self.fail(request, exc)
                    continue
                self.scheduler.finish_request(request, status)

    def add_prompt_logprobs(self, request: Request, start: int, logits: torch.Tensor) -> None:
        """The prompt logprobs a chunk from position ``start`` adds, from its logits ``[len, V]``."""
        group = self.group_of(request)
        have = len(group.prompt_logprobs)
        # Position p's logits score prompt token p + 1; only the prompt part of the chunk counts.
        last = min(start + logits.shape[0], request.num_prompt_tokens - 1)
        if last <= have - 1 or start > have - 1:
            return
        targets = request.prompt_token_ids[have : last + 1]
        rows = logits[have - 1 - start : have - 1 - start + len(targets)]
        entries = compute_prompt_logprobs(rows, targets, group.params.prompt_logprobs)
        group.prompt_logprobs.extend(self._decode_logprobs(e) for e in entries)

    def _decode_logprobs(self, entry: PositionLogprobs) -> PositionLogprobs:
        for token_id, lp in entry.items():
            if lp.decoded_token is None:
                lp.decoded_token = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return entry

    def fail(self, request: Request, exc: Exception) -> None:
        """One broken request must not take the others down: it ends with an error."""
        logger.error("request %s failed: %s", request.request_id, exc, exc_info=exc)
        self.scheduler.finish_request(request, RequestStatus.FINISHED_ERROR)

    # --------------------------------------------------------------------------------------- outputs

    def outputs_of(self, items: list[ScheduledRequest]) -> list[RequestOutput]:
        """Outputs of the groups of ``items`` (every sampled one: finished, or streaming), and the finished
        groups forgotten."""
        touched: dict[str, RequestGroup] = {}
        for item in items:
            request = item.request
            if not request.reports_progress and request.status not in FINISHED_STATUSES:
                continue  # its group (this one sequence) neither reports nor ends: nothing to do
            rid = request.request_id
            group = self.groups.get(rid) or self.groups.get(rid.rpartition("#")[0])
            if group is not None:
                touched[group.request_id] = group
        outputs = []
        finished = []
        for group in touched.values():
            if group.finished:
                finished.append(group)
                outputs.append(group.to_output())
            elif group.params.output_kind is not RequestOutputKind.FINAL_ONLY:
                outputs.append(group.to_output())
        for group in finished:
            self.remove(group.request_id)
        return outputs
