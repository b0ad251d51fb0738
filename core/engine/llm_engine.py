"""LLMEngine: add requests, step, abort. Each step is plan -> run -> postprocess -> outputs: the scheduler
plans, the executor runs the forward on every rank, the sampler picks tokens, the output processor
appends them (detokenizing, stop checks) and makes the outputs. The offline ``LLM`` and the HTTP server
both drive this loop."""

from __future__ import annotations

import logging
import time

from pegainfer.config.schema import EngineConfig
from pegainfer.engine.batch_builder import BatchBuilder, PendingStep
from pegainfer.engine.output_processor import STAT_KEYS, OutputProcessor
from pegainfer.engine.outputs import RequestOutput
from pegainfer.engine.request import FINISHED_STATUSES, Request, RequestStatus
from pegainfer.engine.request_group import RequestGroup, SequenceState
from pegainfer.errors import ConfigError, RequestError
from pegainfer.executor.executor import Executor, ExecutorOutput, build_executor
from pegainfer.memory.buffer_manager import PagedBufferManager
from pegainfer.model.checkpoint import read_generation_config
from pegainfer.model.model_loader import resolve_registration
from pegainfer.plugins.demo import demo_tokenizer
from pegainfer.sampling.sampler import Sampler
from pegainfer.sampling.sampling_params import SamplingParams
from pegainfer.sampling.structured import GrammarCompiler
from pegainfer.scheduling.scheduler import (
    ContinuousBatchingScheduler,
    ScheduledRequest,
    Scheduler,
    SchedulerOutput,
)
from pegainfer.scheduling.speculative import SpeculativeDecoder, sample_and_verify
from pegainfer.text.detokenizer import IncrementalDetokenizer
from pegainfer.text.tokenizer import TOKENIZER_FILE, Tokenizer

logger = logging.getLogger(__name__)

__all__ = ["STAT_KEYS", "LLMEngine", "load_tokenizer"]

#: Prefix-caching refusals already logged (once per process, however many engines start).
_LOGGED_REFUSALS: set[str] = set()


def load_tokenizer(config: EngineConfig) -> Tokenizer:
    """``model.tokenizer`` or the checkpoint's own. A checkpoint without tokenizer files runs under
    ``model.load_format=dummy`` (a config.json alone is enough for random weights) with the demo models'
    byte-level tokenizer, and says so; any other load needs the checkpoint's."""
    if config.model.tokenizer is not None:
        return Tokenizer.from_pretrained(config.model.tokenizer)
    _, folder, _ = resolve_registration(config)
    if config.model.load_format == "dummy" and not (folder / TOKENIZER_FILE).is_file():
        logger.warning(
            "%s has no %s: model.load_format=dummy runs with the demo models' byte-level tokenizer (ids "
            "below 1000 only); set model.tokenizer=DIR to use another",
            folder,
            TOKENIZER_FILE,
        )
        return Tokenizer.from_pretrained(demo_tokenizer())
    return Tokenizer.from_pretrained(folder)


class LLMEngine:
    """Requests in, outputs out: each step is plan -> run -> postprocess -> outputs.

    The engine keeps host bookkeeping only (requests, pages and slots by index, sampling, detokenizing,
    stop checks); everything on a device sits behind its ``Executor`` (``build_executor``), one model
    runner per tensor-parallel rank, which the engine cannot tell apart."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        sched = config.scheduler
        if sched.max_num_batched_tokens < sched.max_num_seqs:
            logger.warning("max_num_batched_tokens < max_num_seqs: some running requests wait every step")
        # The tokenizer first: a checkpoint without one fails before any weight is built.
        self.tokenizer = load_tokenizer(config)
        self.executor: Executor = build_executor(config)
        try:
            self._setup(config)
        except BaseException:
            self.executor.shutdown()
            raise

    def _setup(self, config: EngineConfig) -> None:
        info = self.executor.info
        self.max_model_len = info.max_model_len
        self.generation_config = read_generation_config(info.folder)
        eos = self.generation_config.get("eos_token_id")
        if eos is not None:
            self.tokenizer.add_eos_token_ids([eos] if isinstance(eos, int) else eos)
        self.buffers = PagedBufferManager(
            self.executor.plan,
            prefix_caching=self._prefix_caching(config),
            snapshot_interval_pages=config.cache.snapshot_interval_pages,
            snapshot_inside_chunk_tokens=info.snapshot_inside_chunk_tokens,
            # Pages hold MTP-layer KV keyed by the next token: only drafting with those layers.
            drafts=SpeculativeDecoder.drafts_for if config.speculative.mtp_tokens else None,
        )
        self.scheduler: Scheduler = ContinuousBatchingScheduler(config.scheduler, self.buffers)
        self.sampler = Sampler(seed=config.seed, device=info.device)
        self.grammars = GrammarCompiler(self.tokenizer, info.vocab_size or self.tokenizer.vocab_size)
        self.speculative = SpeculativeDecoder.from_config(
            config.speculative, self.executor, self.buffers, self.scheduler, self.max_model_len
        )
        self.stats = dict.fromkeys(STAT_KEYS, 0)
        self.outputs = OutputProcessor(self.tokenizer, self.scheduler, self.stats)
        self.batches = BatchBuilder(
            self.buffers,
            self.outputs.wants_prompt_logits,
            # MTP layers read the main model's hidden states of each drafting request's chunk.
            SpeculativeDecoder.drafts_for if config.speculative.mtp_tokens else None,
        )
        #: Whether steps are launched ahead of the last step's tokens; may be flipped between steps.
        self.async_scheduling = self._async_scheduling(config)
        self._pending: PendingStep | None = None
        self._wait_s = 0.0

    def _prefix_caching(self, config: EngineConfig) -> bool:
        """``cache.enable_prefix_caching``, unless the model refuses it (its reason logged once)."""
        if not config.cache.enable_prefix_caching:
            return False
        refusal = self.executor.info.prefix_caching_refusal
        if refusal is not None:
            if refusal not in _LOGGED_REFUSALS:
                _LOGGED_REFUSALS.add(refusal)
                logger.warning("%s runs without prefix caching: %s", self.executor.info.name, refusal)
            return False
        plan = self.executor.plan
        if plan.num_state_slots and not plan.num_cache_snapshots:
            logger.warning(
                "prefix caching is off: the model keeps recurrent state and the memory plan holds no state snapshot "
                "(cache.num_state_snapshots)"
            )
            return False
        return True

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Cached prompt tokens over prompt tokens of the requests admitted so far (0 before any)."""
        queries, hits = self.buffers.prefix_cache_stats
        return hits / queries if queries else 0.0

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
                "async_scheduling=true needs an executor that takes decode tokens from the device "
                "(capabilities.carried_tokens) and no speculative decoding; set async_scheduling=false "
                "(or leave it null)"
            )
        if wanted is None:  # on the CPU there is no GPU time to hide the host's work behind
            return able and self.executor.info.device.type == "cuda"
        return wanted

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
        cache_salt: str | None = None,
    ) -> None:
        """Validate and queue a request; ``params.n`` sequences are generated from it. Requests with
        different ``cache_salt`` never share cached prefix pages (vLLM's name: one salt per tenant)."""
        params = params or self.default_sampling_params()
        child_ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        if self.outputs.id_in_use(request_id, child_ids):
            raise RequestError(f"request id {request_id!r} is already in use", param="request_id")
        if prompt_token_ids is None:
            if prompt is None:
                raise RequestError("either a prompt or prompt_token_ids is required", param="prompt")
            prompt_token_ids = self.tokenizer.encode(prompt)
        prompt_token_ids = list(prompt_token_ids)
        self._validate_prompt(prompt_token_ids, params)
        matchers, after = None, None
        if params.structured_outputs is not None:  # compiled once; each sequence gets its own matcher
            after = self.grammars.after_token(params.structured_outputs)
            first = self.grammars.matcher(params.structured_outputs)
            matchers = [first] + [first.deep_copy() for _ in range(params.n - 1)]
        if params.max_tokens is None:
            params = params.clone(max_tokens=self.max_model_len - len(prompt_token_ids))
        params = params.clone(eos_token_ids=self.tokenizer.eos_token_ids)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        group = RequestGroup(request_id, prompt, prompt_token_ids, params, arrival)
        for i in range(params.n):
            child_params = params if params.seed is None else params.clone(seed=params.seed + i)
            request = Request(
                child_ids[i],
                prompt_token_ids,
                child_params,
                arrival_time=arrival,
                prompt=prompt,
                max_model_len=self.max_model_len,
                cache_salt=cache_salt,
            )
            if matchers and after is not None:
                request.deferred_grammar = (after, matchers[i])
            elif matchers:
                request.grammar = matchers[i]
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
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None]
        self.outputs.add(group)
        for seq in group.sequences:
            self.scheduler.add_request(seq.request)
        self.stats["prompt_tokens"] += len(prompt_token_ids)

    def _validate_prompt(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise RequestError("the prompt is empty", param="prompt")
        vocab = self.executor.info.vocab_size
        if vocab is not None and (min(ids) < 0 or max(ids) >= vocab):
            raise RequestError(f"prompt token ids must be in [0, {vocab})", param="prompt")
        if vocab is not None and params.logit_bias and max(params.logit_bias) >= vocab:
            raise RequestError(f"logit_bias token ids must be in [0, {vocab})", param="logit_bias")
        if vocab is not None and params.allowed_token_ids and max(params.allowed_token_ids) >= vocab:
            raise RequestError(f"allowed_token_ids must be in [0, {vocab})", param="allowed_token_ids")
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
        group = self.outputs.remove(request_id)
        if group is not None:
            for seq in group.sequences:
                self.scheduler.finish_request(seq.request, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return bool(self.outputs.groups) or self._pending is not None

    # ------------------------------------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        """Run one step; returns an output for every user request that progressed (finished ones last time).

        With async scheduling a step is launched before the previous one's tokens are read back: its
        decode rows take their tokens from the device, and the previous step's outputs (detokenizing,
        stop checks) are made while this step's forward runs. A step whose plan could preempt or
        recompute a request, or that follows a request's last token, reads the tokens back first."""
        outputs = (
            self._resolve_pending() if self._pending is not None and not self._may_schedule_ahead() else []
        )
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return outputs + (self._resolve_pending() if self._pending is not None else [])
        result = self.executor.execute(self.batches.build(plan, self._pending, self.stats["steps"]))
        self.scheduler.update_after_step(plan)
        self.stats["steps"] += 1
        if self._pending is not None:
            outputs += self._resolve_pending()
        return outputs + self._postprocess(plan, result)

    def _postprocess(self, plan: SchedulerOutput, result: ExecutorOutput) -> list[RequestOutput]:
        """Prompt logprobs of the chunks that asked, then the sampled tokens: left pending on the device
        (async scheduling), or appended now (verifying drafts round by round) with their outputs."""
        if result.all_logits:  # the executor returns them exactly for the chunks that asked
            for item in plan.scheduled:
                logits = result.all_logits.get(item.request.request_id)
                if logits is not None:
                    self.outputs.add_prompt_logprobs(item.request, item.start, logits)
        sampling = [item for item in plan.scheduled if item.samples]
        if not sampling:
            return []
        if self.async_scheduling:
            self._sample_ahead(result, sampling)
            return []
        # One sampler call over the sampled rows, then one more per verified draft (speculative decoding).
        accepted = sample_and_verify(self.sampler, result.logits, sampling, self.outputs.append)
        if self.speculative is not None:
            self.speculative.after_step(plan, sampling, accepted, self.stats)
        return self.outputs.outputs_of(sampling)

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

    def _sample_ahead(self, result: ExecutorOutput, sampling: list[ScheduledRequest]) -> None:
        """Sample on the device and leave the tokens pending: each live request counts one pending token."""
        sample = self.sampler.sample(result.logits, [item.request for item in sampling], result.greedy_tokens)
        row_of = {}
        for row, item in enumerate(sampling):
            request = item.request
            # Finished when the last step's tokens were read: its row is dropped.
            if request.status not in FINISHED_STATUSES:
                request.append_pending_token()
                row_of[request.serial] = row
        self._pending = PendingStep(sampling, sample, row_of)

    def _resolve_pending(self) -> list[RequestOutput]:
        """Read the pending step's tokens back and append them (stop checks, detokenizing, outputs)."""
        pending, self._pending = self._pending, None
        t0 = time.perf_counter()
        sampled = pending.sample.result()
        self._wait_s += time.perf_counter() - t0
        return self.outputs.outputs_of(self.outputs.resolve(pending.items, sampled, pending.row_of))

    def shutdown(self) -> None:
        """Stop the executor (its rank workers, if any). Idempotent."""
        self.executor.shutdown()
