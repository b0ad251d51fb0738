"""The offline API, shaped like vLLM's: ``LLM(model=DIR).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from pegainfer.config.compose import build_model_config
from pegainfer.config.schema import (
    CacheConfig,
    EngineConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    validate_section,
)
from pegainfer.engine.llm_engine import LLMEngine
from pegainfer.engine.outputs import RequestOutput
from pegainfer.errors import RequestError
from pegainfer.sampling.sampling_params import RequestOutputKind, SamplingParams

Message = dict[str, Any]


class LLM:
    """Generate from prompts offline. ``model`` is a checkpoint folder (None: the embedded demo model);
    the plugin is found from its config.json. Keyword arguments use vLLM's names where it has them
    (``speculative_num_tokens`` is ``speculative.num_tokens``: drafts per step, from the model's MTP layers,
    or with ``speculative_method="ngram"`` by prompt lookup over ``prompt_lookup_min..max``-token
    suffixes)."""

    def __init__(
        self,
        model: str | None = None,
        *,
        tokenizer: str | None = None,
        dtype: str = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int = 128,
        max_num_batched_tokens: int = 4096,
        long_prefill_token_threshold: int | None = None,
        block_size: int | None = None,
        gpu_memory_utilization: float = 0.9,
        cpu_kv_cache_bytes: int = 1 << 30,
        num_gpu_blocks_override: int | None = None,
        enable_prefix_caching: bool = True,
        tensor_parallel_size: int = 1,
        device: str = "auto",
        seed: int = 0,
        enforce_eager: bool = False,
        prefill_graph_max_tokens: int = 128,
        speculative_num_tokens: int = 0,
        speculative_method: str = "mtp",
        prompt_lookup_min: int = 2,
        prompt_lookup_max: int = 4,
        async_scheduling: bool | None = None,
    ) -> None:
        config = EngineConfig(
            model=build_model_config(
                {"path": model, "tokenizer": tokenizer, "dtype": dtype, "max_model_len": max_model_len}
            ),
            cache=validate_section(
                CacheConfig,
                {
                    "block_size": block_size,
                    "gpu_memory_utilization": gpu_memory_utilization,
                    "cpu_kv_cache_bytes": cpu_kv_cache_bytes,
                    "num_gpu_blocks_override": num_gpu_blocks_override,
                    "enable_prefix_caching": enable_prefix_caching,
                },
                "cache",
            ),
            scheduler=validate_section(
                SchedulerConfig,
                {
                    "max_num_seqs": max_num_seqs,
                    "max_num_batched_tokens": max_num_batched_tokens,
                    "long_prefill_token_threshold": long_prefill_token_threshold,
                },
                "scheduler",
            ),
            parallel=validate_section(
                ParallelConfig, {"tensor_parallel_size": tensor_parallel_size}, "parallel"
            ),
            speculative=validate_section(
                SpeculativeConfig,
                {
                    "num_tokens": speculative_num_tokens,
                    "method": speculative_method,
                    "prompt_lookup_min": prompt_lookup_min,
                    "prompt_lookup_max": prompt_lookup_max,
                },
                "speculative",
            ),
            device=device,
            seed=seed,
            enforce_eager=enforce_eager,
            prefill_graph_max_tokens=prefill_graph_max_tokens,
            async_scheduling=async_scheduling,
        )
        self.engine = LLMEngine(config)
        self._ids = itertools.count()

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        """Build from a validated EngineConfig (what the CLI composes with Hydra)."""
        llm = cls.__new__(cls)
        llm.engine = LLMEngine(config)
        llm._ids = itertools.count()
        return llm

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        return self.engine.default_sampling_params()

    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One finished RequestOutput per prompt, in the order given."""
        if prompt_token_ids is not None:
            inputs = [(None, list(ids)) for ids in prompt_token_ids]
        elif prompts is not None:
            inputs = [(p, None) for p in ([prompts] if isinstance(prompts, str) else prompts)]
        else:
            raise RequestError("generate() needs prompts or prompt_token_ids")
        return self._run(inputs, sampling_params, use_tqdm)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation with the checkpoint's chat template (``tools``: OpenAI's tool list,
        which the template shows the model), then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        inputs = []
        for conversation in conversations:
            text = tok.apply_chat_template(
                conversation,
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
                tools=tools,
                **(chat_template_kwargs or {}),
            )
            inputs.append((text, tok.encode(text, add_special_tokens=False)))
        return self._run(inputs, sampling_params, use_tqdm)

    def _run(
        self,
        inputs: list[tuple[str | None, list[int] | None]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or self.get_default_sampling_params()] * len(inputs)
        else:
            params = list(sampling_params)
            if len(params) != len(inputs):
                raise RequestError(f"got {len(params)} sampling_params for {len(inputs)} prompts")
        # Offline runs only need each request's final result: no per-step output objects.
        params = [p.clone(output_kind=RequestOutputKind.FINAL_ONLY) for p in params]
        engine = self.engine
        ids = []
        try:
            for (text, token_ids), p in zip(inputs, params, strict=True):
                rid = str(next(self._ids))
                engine.add_request(rid, text, p, prompt_token_ids=token_ids)
                ids.append(rid)
            finished: dict[str, RequestOutput] = {}
            with tqdm(total=len(ids), desc="generating", disable=not use_tqdm, unit="req") as bar:
                while engine.has_unfinished_requests():
                    for out in engine.step():
                        if out.finished:
                            finished[out.request_id] = out
                            bar.update(1)
        except BaseException:
            for rid in ids:
                engine.abort_request(rid)
            raise
        return [finished[rid] for rid in ids]
