"""LLMEngine: add requests, step, abort. Each step: scheduler plan -> executor forward -> sampler ->
detokenizer and stop checks -> outputs. The offline ``LLM`` and the HTTP server both drive this loop."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from pegainfer.buffer_specs import TransientSpec, dtype_size
from pegainfer.buffers import PagedBufferManager
from pegainfer.config import EngineConfig
from pegainfer.detokenizer import IncrementalDetokenizer
from pegainfer.errors import ConfigError, RequestError
from pegainfer.executor import Executor, LocalExecutor, ModelBatch, SequenceChunk
from pegainfer.loader import read_generation_config
from pegainfer.memory_plan import MemoryPlan, plan_memory
from pegainfer.model_loader import LoadedModel, load_model
from pegainfer.outputs import PositionLogprobs, RequestOutput
from pegainfer.persistent_batch import PersistentDecodeBatch
from pegainfer.request import FINISHED_STATUSES, PENDING_TOKEN, Request, RequestStatus
from pegainfer.request_group import RequestGroup, SequenceState
from pegainfer.sampler import DeviceSample, Sampler, compute_prompt_logprobs
from pegainfer.sampling_params import RequestOutputKind, SamplingParams
from pegainfer.scheduler import (
    PROMPT_LOGPROBS_CHUNK,
    ContinuousBatchingScheduler,
    ScheduledRequest,
    Scheduler,
    SchedulerOutput,
)
from pegainfer.speculative import SpeculativeDecoder, draft_buffer_specs, sample_and_verify
from pegainfer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

#: ``LLMEngine.stats`` counters (the spec_* ones: draft tokens verified and accepted, all requests).
STAT_KEYS = ("prompt_tokens", "generation_tokens", "steps", "spec_draft_tokens", "spec_accepted_tokens")


@dataclass
class _PendingStep:
    """A launched step whose sampled tokens are still on the device (async scheduling)."""

    items: list[ScheduledRequest]  # the sampling items, in the sampled rows' order
    sample: DeviceSample
    row_of: dict[int, int]  # request serial -> its row in ``sample.tokens``


def _memory_budget(loaded: LoadedModel, config: EngineConfig, transient_bytes: int) -> int:
    """Bytes this replica may hold in all: on a GPU a fraction of the device; on the CPU weights +
    transients + the configured KV budget."""
    if loaded.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(loaded.device)
        # Memory our allocator holds (weights, its cache) is ours, not another process's.
        used_by_others = total - free - torch.cuda.memory_reserved(loaded.device)
        return int(total * config.cache.gpu_memory_utilization) - used_by_others
    return loaded.weight_bytes + transient_bytes + config.cache.cpu_kv_cache_bytes


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        if config.parallel.tensor_parallel_size != 1:
            raise ConfigError("parallel.tensor_parallel_size (tp) > 1 is not implemented yet; run with tp=1")
        self.config = config
        loaded = load_model(config)
        self.loaded = loaded
        self.model = loaded.model
        self.max_model_len = loaded.max_model_len
        self.tokenizer = Tokenizer.from_pretrained(config.model.tokenizer or loaded.folder)
        self.generation_config = read_generation_config(loaded.folder)
        eos = self.generation_config.get("eos_token_id")
        if eos is not None:
            self.tokenizer.add_eos_token_ids([eos] if isinstance(eos, int) else eos)
        sched = config.scheduler
        if sched.max_num_batched_tokens < sched.max_num_seqs:
            logger.warning("max_num_batched_tokens < max_num_seqs: some running requests wait every step")
        num_spec = config.speculative.num_tokens
        # Drafting adds the draft layers' caches to the pages (same block table as the main layers).
        specs = [*self.model.buffer_specs(), *draft_buffer_specs(self.model, num_spec)]
        transients = [*self.model.transient_specs(), *self._engine_transients()]
        budget = _memory_budget(
            loaded,
            config,
            sum(t.bytes_for(sched.max_num_batched_tokens, sched.max_num_seqs) for t in transients),
        )
        self.plan: MemoryPlan = plan_memory(
            budget=budget,
            weight_bytes=loaded.weight_bytes,
            specs=specs,
            transients=transients,
            block_size=config.cache.block_size,
            max_num_seqs=sched.max_num_seqs,
            max_num_batched_tokens=sched.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            num_blocks_override=config.cache.num_gpu_blocks_override,
        )
        logger.info(self.plan.describe())
        self.buffers = PagedBufferManager(specs, self.plan, loaded.device)
        self.buffers.allocate_device_buffers()
        self.executor: Executor = LocalExecutor(
            self.model,
            self.buffers,
            max_num_seqs=sched.max_num_seqs,
            max_model_len=self.max_model_len,
            num_speculative_tokens=num_spec,
        )
        if loaded.device.type == "cuda" and self.model.embeds_on_device:
            self.executor.capture_decode_graphs(eager=config.enforce_eager)
        self.scheduler: Scheduler = ContinuousBatchingScheduler(sched, self.buffers)
        self.sampler = Sampler(seed=config.seed, device=loaded.device)
        self.speculative = (
            SpeculativeDecoder(num_spec, self.executor, self.buffers, self.scheduler, self.max_model_len)
            if num_spec
            else None
        )
        self._groups: dict[str, RequestGroup] = {}
        self._sequences: dict[str, SequenceState] = {}
        self.stats = dict.fromkeys(STAT_KEYS, 0)
        #: Whether steps are launched ahead of the last step's tokens; may be flipped between steps.
        self.async_scheduling = self._async_scheduling(config)
        self._pending: _PendingStep | None = None
        self._decode_batch = PersistentDecodeBatch()
        self._wait_s = 0.0

    @property
    def wait_time_s(self) -> float:
        """Seconds the host spent blocked on the GPU (sampled tokens, uploads, graph launches) since start:
        the engine's own host time over some steps is their wall time minus this."""
        return self._wait_s + self.executor.wait_time_s

    def _async_scheduling(self, config: EngineConfig) -> bool:
        wanted = config.async_scheduling
        able = self.speculative is None and self.executor.capabilities.carried_tokens
        if wanted and not able:
            raise ConfigError(
                "async_scheduling=true needs an executor that embeds tokens on the device and no "
                "speculative decoding; set async_scheduling=false (or leave it null)"
            )
        if wanted is None:  # on the CPU there is no GPU time to hide the host's work behind
            return able and self.loaded.device.type == "cuda"
        return wanted

    @property
    def _use_graphs(self) -> bool:
        return (
            self.loaded.device.type == "cuda"
            and not self.config.enforce_eager
            and self.model.embeds_on_device
        )

    def _engine_transients(self) -> list[TransientSpec]:
        vocab = getattr(self.model, "vocab_size", 0)
        num_spec = self.config.speculative.num_tokens
        max_blocks = -(-self.max_model_len // self.config.cache.block_size)
        specs = [
            # Logits of the sampled rows (1 + drafts per request) and the sampler's working copies of them.
            TransientSpec("sampler", bytes_per_seq=(4 + num_spec) * vocab * dtype_size(torch.float32)),
            # Prompt logprobs: the logits of one bounded chunk and their log-softmax copy.
            TransientSpec("prompt_logprobs", bytes_fixed=2 * PROMPT_LOGPROBS_CHUNK * vocab * 4),
            # Persistent decode inputs: block-table row plus token, position, length, slot and state slot.
            TransientSpec("decode_buffers", bytes_per_seq=4 * max_blocks + 5 * 8),
        ]
        if self._use_graphs:
            # The graph pool keeps the largest bucket's activations (one token per row, as the model
            # declares them per token) and its static logits.
            per_row = sum(t.bytes_per_token for t in self.model.transient_specs())
            specs.append(
                TransientSpec("cuda_graphs", bytes_fixed=64 << 20, bytes_per_seq=4 * vocab + per_row)
            )
        return specs

    # ----------------------------------------------------------------------------------------- requests

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the checkpoint's generation_config.json defaults (temperature, top_p, top_k)."""
        g = self.generation_config
        keys = {
            "temperature": "temperature",
            "top_p": "top_p",
            "top_k": "top_k",
            "min_p": "min_p",
            "repetition_penalty": "repetition_penalty",
        }
        values = {ours: g[theirs] for theirs, ours in keys.items() if g.get(theirs) is not None}
        if g.get("do_sample") is False:
            values["temperature"] = 0.0
        return SamplingParams(**values)

    def add_request(
        self,
        request_id: str,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Validate and queue a request; ``params.n`` sequences are generated from it."""
        params = params or self.default_sampling_params()
        child_ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        # A parent id and the n child ids share one namespace with every live sequence: "a" with n=2
        # creates "a#1", which must not silently replace a live request named "a#1" (or vice versa).
        if request_id in self._groups or any(
            cid in self._sequences or cid in self._groups for cid in child_ids
        ):
            raise RequestError(f"request id {request_id!r} is already in use", param="request_id")
        if prompt_token_ids is None:
            if prompt is None:
                raise RequestError("either a prompt or prompt_token_ids is required", param="prompt")
            prompt_token_ids = self.tokenizer.encode(prompt)
        prompt_token_ids = list(prompt_token_ids)
        self._validate_prompt(prompt_token_ids, params)
        if params.max_tokens is None:
            params = params.clone(max_tokens=self.max_model_len - len(prompt_token_ids))
        params = params.clone(eos_token_ids=self.tokenizer.eos_token_ids)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        group = RequestGroup(request_id, prompt, prompt_token_ids, params, arrival)
        for i in range(params.n):
            child_params = params if params.seed is None else params.clone(seed=params.seed + i)
            child_id = child_ids[i]
            request = Request(
                child_id,
                prompt_token_ids,
                child_params,
                arrival_time=arrival,
                prompt=prompt,
                max_model_len=self.max_model_len,
            )
            seq = SequenceState(
                request,
                i,
                IncrementalDetokenizer(
                    self.tokenizer,
                    prompt_token_ids,
                    skip_special_tokens=params.skip_special_tokens,
                    stop=params.stop,
                    include_stop_str_in_output=params.include_stop_str_in_output,
                ),
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None,
            )
            group.sequences.append(seq)
            self._sequences[child_id] = seq
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None]
        self._groups[request_id] = group
        for seq in group.sequences:
            self.scheduler.add_request(seq.request)
        self.stats["prompt_tokens"] += len(prompt_token_ids)

    def _validate_prompt(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise RequestError("the prompt is empty", param="prompt")
        vocab = getattr(self.model, "vocab_size", None)
        if vocab is not None and (min(ids) < 0 or max(ids) >= vocab):
            raise RequestError(f"prompt token ids must be in [0, {vocab})", param="prompt")
        sched = self.config.scheduler
        if not sched.enable_chunked_prefill and len(ids) > sched.max_num_batched_tokens:
            raise RequestError(
                f"the prompt has {len(ids)} tokens, more than scheduler.max_num_batched_tokens "
                f"({sched.max_num_batched_tokens}) allows without chunked prefill",
                param="prompt",
            )
        wanted = len(ids) + (params.max_tokens or 1)
        if wanted > self.max_model_len:
            raise RequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{wanted} tokens ({len(ids)} in the prompt, {wanted - len(ids)} for the completion).",
                param="max_tokens",
            )

    def abort_request(self, request_id: str) -> None:
        """Abort a request and all its sequences; their pages and slots are freed at once."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return
        for seq in group.sequences:
            self.scheduler.finish_request(seq.request, RequestStatus.FINISHED_ABORTED)
            self._sequences.pop(seq.request.request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups) or self._pending is not None

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._groups)

    # ------------------------------------------------------------------------------------------ the step

    def _build_batch(self, plan: SchedulerOutput) -> ModelBatch:
        """The step's batch: last step's moved on in the steady state of async decoding (see
        PersistentDecodeBatch), else a chunk built for every planned request."""
        step = self.stats["steps"]
        if self._pending is not None:
            batch = self._decode_batch.reuse(plan.scheduled, self._pending.sample.tokens, step)
            if batch is not None:
                return batch
        batch = self._new_batch(plan)
        self._decode_batch.remember(plan.scheduled, batch, step)
        return batch

    def _new_batch(self, plan: SchedulerOutput) -> ModelBatch:
        chunks = []
        pending = self._pending
        block_table, state_slot = self.buffers.block_table, self.buffers.state_slot
        speculative = self.speculative
        for item in plan.scheduled:
            req = item.request
            spec = item.spec_token_ids
            start = item.start
            end = start + item.num_new_tokens - len(spec)
            all_ids = req.all_token_ids
            # A group keeps prompt logprobs exactly when its requests' params ask for them.
            all_logits = False
            if req.sampling_params.prompt_logprobs is not None:
                group = self._groups[self._group_id(req)]
                all_logits = (
                    len(group.prompt_logprobs) < req.num_prompt_tokens and start < req.num_prompt_tokens
                )
            carry_from = -1
            if all_ids[end - 1] == PENDING_TOKEN:
                # Scheduled ahead: the token is the last step's, still on the device (a decode chunk only).
                if end - start != 1 or pending is None:
                    raise RuntimeError(f"{req.request_id}: a pending token in a {end - start}-token chunk")
                carry_from = pending.row_of[req.serial]
            rid = req.request_id
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
                    speculative is not None and speculative.drafts_for(req),  # keep_hidden
                    carry_from,
                )
            )
        batch = ModelBatch(chunks)
        if pending is not None:
            batch.carried_tokens = pending.sample.tokens
        if not self.executor.capabilities.device_embedding:
            batch.hidden_states = self.executor.embed([t for c in chunks for t in c.token_ids])
        return batch

    def _group_id(self, request: Request) -> str:
        rid = request.request_id
        return rid if rid in self._groups else rid.rpartition("#")[0]

    def step(self) -> list[RequestOutput]:
        """Run one step; returns an output for every user request that progressed (finished ones last time).

        With async scheduling a step is launched before the previous one's tokens are read back: its
        decode rows take their tokens from the device, and the previous step's outputs (detokenizing,
        stop checks) are made while this step's forward runs. A step whose plan could preempt or
        recompute a request, or that follows a request's last token, reads the tokens back first."""
        outputs: list[RequestOutput] = []
        if self._pending is not None and not self._may_schedule_ahead():
            outputs = self._resolve_pending()
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return outputs + (self._resolve_pending() if self._pending is not None else [])
        batch = self._build_batch(plan)
        result = self.executor.execute(batch)
        self.scheduler.update_after_step(plan)
        self.stats["steps"] += 1
        if self._pending is not None:
            outputs += self._resolve_pending()
        if result.all_logits:  # the executor returns them exactly for the chunks that asked
            for chunk, item in zip(batch.chunks, plan.scheduled, strict=True):
                if chunk.all_logits:
                    self._add_prompt_logprobs(item.request, chunk, result.all_logits[chunk.request_id])
        sampling = [item for item in plan.scheduled if item.samples]
        if not sampling:
            return outputs
        if self.async_scheduling:
            self._sample_ahead(result.logits, result.greedy_tokens, sampling)
            return outputs
        # One sampler call over the sampled rows, then one more per verified draft (speculative decoding).
        accepted = sample_and_verify(self.sampler, result.logits, sampling, self._append)
        if self.speculative is not None:
            self.speculative.after_step(plan, sampling, accepted, self.stats)
        return outputs + self._outputs_of(sampling)

    def _outputs_of(self, items: list[ScheduledRequest]) -> list[RequestOutput]:
        """Outputs of the groups of ``items`` (every sampled one: finished, or streaming), and the finished
        groups forgotten."""
        groups = self._groups
        touched: dict[str, RequestGroup] = {}
        for item in items:
            request = item.request
            if not request.reports_progress and request.status not in FINISHED_STATUSES:
                continue  # its group (this one sequence) neither reports nor ends: nothing to do
            group = groups.get(self._group_id(request))
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
            groups.pop(group.request_id, None)
            for seq in group.sequences:
                self._sequences.pop(seq.request.request_id, None)
        return outputs

    def _may_schedule_ahead(self) -> bool:
        """Whether the next step can be planned before the pending tokens are known: the scheduler will not
        preempt, and no pending request is sure to end with its pending token (it would be planned again)."""
        if not self.scheduler.can_schedule_ahead():
            return False
        for item in self._pending.items:
            request = item.request
            if (
                len(request.all_token_ids) >= request.max_num_tokens
                and request.status not in FINISHED_STATUSES
            ):
                return False
        return True

    def _sample_ahead(
        self, logits: torch.Tensor, greedy: torch.Tensor | None, sampling: list[ScheduledRequest]
    ) -> None:
        """Sample on the device and leave the tokens pending: each live request counts one pending token."""
        sample = self.sampler.sample(logits, [item.request for item in sampling], greedy)
        row_of = {}
        for row, item in enumerate(sampling):
            request = item.request
            # Finished when the last step's tokens were read: its row is dropped.
            if request.status not in FINISHED_STATUSES:
                request.append_pending_token()
                row_of[request.serial] = row
        self._pending = _PendingStep(sampling, sample, row_of)

    def _resolve_pending(self) -> list[RequestOutput]:
        """Read the pending step's tokens back and append them (stop checks, detokenizing, outputs)."""
        pending, self._pending = self._pending, None
        t0 = time.perf_counter()
        sampled = pending.sample.result()
        self._wait_s += time.perf_counter() - t0
        resolved = []
        done: list[tuple[SequenceState, int, PositionLogprobs | None]] = []
        row_of, sequences = pending.row_of, self._sequences
        token_ids, logprobs = sampled.token_ids, sampled.logprobs
        for row, item in enumerate(pending.items):
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
        self._after_tokens(done)
        return self._outputs_of(resolved)

    def _add_prompt_logprobs(self, request: Request, chunk: SequenceChunk, logits: torch.Tensor) -> None:
        group = self._groups[self._group_id(request)]
        have = len(group.prompt_logprobs)
        # Position p's logits score prompt token p + 1; only the prompt part of the chunk counts.
        last = min(chunk.start + len(chunk.token_ids), request.num_prompt_tokens - 1)
        if last <= have - 1 or chunk.start > have - 1:
            return
        targets = request.prompt_token_ids[have : last + 1]
        rows = logits[have - 1 - chunk.start : have - 1 - chunk.start + len(targets)]
        entries = compute_prompt_logprobs(rows, targets, group.params.prompt_logprobs)
        group.prompt_logprobs.extend(self._decode_logprobs(e) for e in entries)

    def _decode_logprobs(self, entry: PositionLogprobs) -> PositionLogprobs:
        for token_id, lp in entry.items():
            if lp.decoded_token is None:
                lp.decoded_token = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return entry

    def _append(self, request: Request, token: int, logprobs: PositionLogprobs | None) -> bool:
        """Append one sampled token; False once the request finished (stopped, length, or failed)."""
        try:
            self._append_token(self._sequences[request.request_id], token, logprobs)
        except Exception as exc:
            self._fail(request, exc)
        return not request.is_finished

    def _append_token(self, seq: SequenceState, token: int, logprobs: PositionLogprobs | None) -> None:
        seq.request.append_output_token(token)
        self._after_tokens([(seq, token, logprobs)])

    def _after_tokens(self, done: list[tuple[SequenceState, int, PositionLogprobs | None]]) -> None:
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
                    self._fail(request, exc)
            num_tokens = len(request.all_token_ids)
            # Before min_tokens no stop condition applies (the sampler already bans EOS and stop ids), stop
            # strings included, as in vLLM.
            check = num_tokens >= request.min_num_tokens
            try:  # a failed request's text still takes its last token
                stop_str = seq.detokenizer.update_one(token, check)
            except Exception as exc:
                if request.status not in FINISHED_STATUSES:
                    self._fail(request, exc)
                continue
            if request.status in FINISHED_STATUSES:
                continue  # failed above
            status = None
            if stop_str is not None:
                status, request.stop_reason = RequestStatus.FINISHED_STOPPED, stop_str
            elif check and token in request.stop_ids:
                status = RequestStatus.FINISHED_STOPPED
                if token in request.sampling_params.stop_token_ids:  # EOS leaves no stop reason
                    request.stop_reason = token
            elif num_tokens >= request.max_num_tokens:
                status = RequestStatus.FINISHED_LENGTH
            if status is not None:
                try:
                    seq.detokenizer.finish()
                except Exception as exc:
                    self._fail(request, exc)
                    continue
                self.scheduler.finish_request(request, status)

    def _fail(self, request: Request, exc: Exception) -> None:
        """One broken request must not take the others down: it ends with an error."""
        logger.error("request %s failed: %s", request.request_id, exc, exc_info=exc)
        self.scheduler.finish_request(request, RequestStatus.FINISHED_ERROR)

    def shutdown(self) -> None:
        self.executor.shutdown()
