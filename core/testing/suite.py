"""The conformance suite a model plugin runs with one subclass.

    from pegainfer.testing.suite import PluginConformance

    class TestMyModel(PluginConformance):
        model_name = "my_model"            # the name the plugin registers (the Hydra model= option)
        architecture = "qwen3"             # a pegainfer.testing.checkpoints architecture, or override
                                           # make_checkpoint() to write your own tiny checkpoint

Checks: the model is discovered through its entry point, its Hydra ``model/`` option composes and
validates, every checkpoint tensor is consumed, a tiny model generates on the CPU, batched generation
equals one-at-a-time generation, chunked prefill and a preempted run equal a plain run; with
``hf_reference = True`` greedy tokens (one prompt, a batch) equal transformers', and the logits of a
prompt (prefill) and of the steps after it (decode through the paged cache) are within ``logits_tolerance``
of transformers' (relative L2 over the positions); with ``tensor_parallel_size`` > 0 the model runs on that
many ranks (gloo, CPU) with transformers' tokens and one rank's logprobs and seeded samples (0: the model
refuses tensor parallelism, which is checked to be a clear error); with prefix caching on, greedy tokens
equal those with it off (a repeated prompt, prefixes of every length around page boundaries hit by one
batch at once, eviction under page pressure, preemption of requests whose pages are shared), and the
cache is really hit (``prefix_caching = False``: the model refuses with a reason and runs uncached).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, ClassVar

import pytest

from pegainfer.sampling.sampling_params import SamplingParams

#: The shared-prefix lengths of the prefix-caching checks (4-token pages, snapshots every 8 tokens).
PREFIX_LENGTHS = (3, 4, 5, 7, 8, 9, 12, 16, 17)


class PluginConformance:
    model_name: ClassVar[str]
    architecture: ClassVar[str] = "qwen3"
    checkpoint_options: ClassVar[dict[str, Any]] = {}
    #: Compare greedy tokens with transformers (it must know the checkpoint's architecture).
    hf_reference: ClassVar[bool] = True
    max_tokens: ClassVar[int] = 12
    #: Relative L2 error allowed between our float32 logits and transformers' (prefill and decode).
    logits_tolerance: ClassVar[float] = 1e-4
    #: Ranks of the tensor-parallel check (0: the model refuses tp > 1, which is checked instead).
    tensor_parallel_size: ClassVar[int] = 2
    #: The tensor-parallel check also schedules ahead (models that embed on the device).
    async_scheduling: ClassVar[bool] = True
    #: Draft tokens during the tensor-parallel check (models with MTP layers).
    speculative_num_tokens: ClassVar[int] = 0
    #: The model reuses cached prefixes (False: it refuses prefix caching, with a reason, and runs uncached,
    #: which is checked instead).
    prefix_caching: ClassVar[bool] = True

    @classmethod
    def make_checkpoint(cls, folder: Path) -> Path:
        from pegainfer.testing.checkpoints import write_tiny_checkpoint

        return write_tiny_checkpoint(folder, cls.architecture, **cls.checkpoint_options)

    @classmethod
    def reference_checkpoint(cls, folder: Path) -> Path:
        """The folder transformers loads as the reference for ``folder`` (the same weights): the folder
        itself, unless the plugin's architecture name is one transformers does not know."""
        return folder

    def prompts(self) -> list[list[int]]:
        rng = random.Random(0)
        return [[rng.randrange(200) for _ in range(n)] for n in (5, 17, 2, 40)]

    def test_discovered_through_entry_point(self) -> None:
        from pegainfer.plugins.registry import get_model_registry

        registration = get_model_registry().get(self.model_name)
        assert registration.plugin and registration.package

    def test_config_composes_with_plugin_schema(self, conformance_checkpoint: Path) -> None:
        from pegainfer.config.compose import build_engine_config, compose

        config = build_engine_config(
            compose("generate", [f"model={self.model_name}", f"model.path={conformance_checkpoint}"])
        )
        assert config.model.name == self.model_name
        assert Path(config.model.path) == conformance_checkpoint

    def test_every_checkpoint_tensor_is_used(self, conformance_checkpoint: Path) -> None:
        from pegainfer.testing.conformance import unused_checkpoint_tensors

        assert unused_checkpoint_tensors(conformance_checkpoint, self.model_name) == []

    def test_batched_equals_one_at_a_time(self, conformance_llm: Any) -> None:
        params = SamplingParams(temperature=0, max_tokens=self.max_tokens, ignore_eos=True)
        batched = conformance_llm.generate(
            prompt_token_ids=self.prompts(), sampling_params=params, use_tqdm=False
        )
        single = [
            conformance_llm.generate(prompt_token_ids=[p], sampling_params=params, use_tqdm=False)[0]
            for p in self.prompts()
        ]
        assert [o.outputs[0].token_ids for o in batched] == [o.outputs[0].token_ids for o in single]
        assert all(len(o.outputs[0].token_ids) == self.max_tokens for o in batched)
        conformance_llm.engine.buffers.check_invariants()

    def _variant(self, checkpoint: Path, *overrides: str) -> Any:
        from pegainfer.config.compose import build_engine_config, compose
        from pegainfer.engine.llm import LLM

        base = [f"model={self.model_name}", f"model.path={checkpoint}", "device=cpu", "model.dtype=float32"]
        return LLM.from_config(build_engine_config(compose("generate", [*base, *overrides])))

    def _greedy(self, llm: Any) -> list[list[int]]:
        params = SamplingParams(temperature=0, max_tokens=self.max_tokens, ignore_eos=True)
        outs = llm.generate(prompt_token_ids=self.prompts(), sampling_params=params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    def test_chunked_prefill_equals_one_pass(
        self, conformance_llm: Any, conformance_checkpoint: Path
    ) -> None:
        """Prompts split into 3-token chunks over 8-token steps give the tokens of whole-prompt prefill."""
        chunked = self._variant(
            conformance_checkpoint,
            "scheduler.long_prefill_token_threshold=3",
            "scheduler.max_num_batched_tokens=8",
            "cache.cpu_kv_cache_bytes=8388608",
        )
        assert self._greedy(chunked) == self._greedy(conformance_llm)

    def test_preempted_run_equals_unpreempted(
        self, conformance_llm: Any, conformance_checkpoint: Path
    ) -> None:
        """A page pool too small for all requests forces preemption; recompute gives the same tokens."""
        longest = max(len(p) for p in self.prompts()) + self.max_tokens
        pages = -(-longest // 4) + 1
        small = self._variant(
            conformance_checkpoint,
            "cache.block_size=4",
            f"cache.num_gpu_blocks_override={pages}",
            f"model.max_model_len={longest}",
        )
        params = SamplingParams(temperature=0, max_tokens=self.max_tokens, ignore_eos=True)
        outs = small.generate(prompt_token_ids=self.prompts(), sampling_params=params, use_tqdm=False)
        assert sum(o.metrics.num_preemptions for o in outs) > 0
        assert [o.outputs[0].token_ids for o in outs] == self._greedy(conformance_llm)
        small.engine.buffers.check_invariants()
        assert small.engine.buffers.pool.num_free == pages

    def _needs_transformers(self) -> None:
        if not self.hf_reference:
            pytest.skip("this plugin has no transformers reference")

    def test_greedy_matches_transformers(self, conformance_llm: Any, conformance_checkpoint: Path) -> None:
        """One prompt alone, then the batch: transformers' greedy tokens."""
        self._needs_transformers()
        from pegainfer.testing.conformance import hf_greedy

        params = SamplingParams(temperature=0, max_tokens=self.max_tokens, ignore_eos=True)
        for prompts in (self.prompts()[1:2], self.prompts()):
            outs = conformance_llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outs] == hf_greedy(
                self.reference_checkpoint(conformance_checkpoint), prompts, self.max_tokens
            )

    def test_prefill_and_decode_logits_match_transformers(
        self, conformance_llm: Any, conformance_checkpoint: Path
    ) -> None:
        """Teacher-forced: a 21-token prompt's logits in one chunk, then 9 decode steps through the paged
        cache, each within ``logits_tolerance`` of transformers' logits at the same positions."""
        self._needs_transformers()
        from pegainfer.testing.conformance import teacher_forced_errors

        prefill, decode = teacher_forced_errors(
            conformance_llm, self.reference_checkpoint(conformance_checkpoint)
        )
        assert prefill < self.logits_tolerance, f"prefill logits: relative error {prefill:.2e}"
        assert decode < self.logits_tolerance, f"decode logits: relative error {decode:.2e}"

    def test_tensor_parallel(self, conformance_checkpoint: Path) -> None:
        """On ``tensor_parallel_size`` ranks: transformers' tokens, one rank's logprobs and seeded samples,
        chunked prefill and preemption (``conformance.assert_tensor_parallel_matches``); or, for a model
        that refuses tensor parallelism, a ConfigError before any rank starts serving."""
        if not self.tensor_parallel_size:
            from pegainfer.errors import ConfigError

            with pytest.raises(ConfigError, match="tensor parallel"):
                self._variant(conformance_checkpoint, "tp=2")
            return
        self._needs_transformers()
        from pegainfer.testing.conformance import assert_tensor_parallel_matches

        assert_tensor_parallel_matches(
            conformance_checkpoint,
            reference=self.reference_checkpoint(conformance_checkpoint),
            tp=self.tensor_parallel_size,
            async_scheduling=self.async_scheduling,
            speculative_num_tokens=self.speculative_num_tokens,
        )

    # ------------------------------------------------------------------------------- prefix caching

    def _prefix_rounds(self) -> tuple[list[int], list[list[list[int]]]]:
        """A 24-token base prompt and the rounds run after it: the base again, then one batch of prompts
        sharing its first k tokens (k around the 4-token page boundaries and the 8-token snapshot interval)
        with their own 5-token tails, then the batch again (longer hits: their own pages are cached), then
        the same prefixes with other tails (models with state: the snapshots the batch left where its
        cached pages ended)."""
        rng = random.Random(5)
        base = [rng.randrange(200) for _ in range(24)]
        shared = [base[:k] + [rng.randrange(200) for _ in range(5)] for k in PREFIX_LENGTHS]
        other = [base[:k] + [rng.randrange(200) for _ in range(5)] for k in PREFIX_LENGTHS]
        return base, [[base], shared, shared, other]

    def _run_rounds(self, llm: Any, rounds: list[list[list[int]]], max_tokens: int) -> list[Any]:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        outs = []
        for prompts in rounds:
            outs.append(llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False))
            llm.engine.buffers.check_invariants()
        return outs

    def test_prefix_caching_matches_uncached(self, conformance_checkpoint: Path) -> None:
        """Greedy tokens with prefix caching equal those without (and transformers' for the base prompt),
        over 4-token pages and snapshots every 2 pages: the base prompt, then the base again (a full hit
        but its last token), then a batch whose prompts share 3..17 tokens with it, hitting its pages at
        once, then that batch again, then those prefixes with other tails; the cache is hit where it must
        be."""
        base, rounds = self._prefix_rounds()
        small = ["cache.block_size=4", "cache.snapshot_interval_pages=2", "model.max_model_len=64"]
        if self.async_scheduling:
            small.append("async_scheduling=true")
        off = self._variant(conformance_checkpoint, *small, "cache.enable_prefix_caching=false")
        expected = [
            [o.outputs[0].token_ids for o in outs] for outs in self._run_rounds(off, [[base], *rounds], 6)
        ]
        assert off.engine.buffers.prefix_cache_stats == (0, 0)
        on = self._variant(conformance_checkpoint, *small)
        if not self.prefix_caching:
            assert on.engine.executor.info.prefix_caching_refusal, "a refusal names its reason"
            assert not on.engine.buffers.caching
        outs = self._run_rounds(on, [[base], *rounds], 6)
        assert [[o.outputs[0].token_ids for o in r] for r in outs] == expected
        cached = [[o.num_cached_tokens for o in r] for r in outs]
        if not self.prefix_caching:
            assert cached == [[0] * len(r) for r in outs]
            return
        if self.hf_reference:
            from pegainfer.testing.conformance import hf_greedy

            assert expected[0] == hf_greedy(self.reference_checkpoint(conformance_checkpoint), [base], 6)
        hybrid = on.engine.buffers.cuts_chunks
        assert cached[0] == [0]
        assert cached[1] == [20], "the repeated prompt hits all of its pages but the last token's"
        # Attention alone hits every shared full page; recurrent state only where a snapshot was taken
        # (every 2 pages, and the base prompt's last page boundary, 20). And where one is about to be: the
        # request sharing 4 tokens computes the base's page 0 again (no snapshot at 4) and leaves one
        # there, where its cached pages end; those sharing 5 and 7, whose next page that is, wait the step
        # for it and hit 4.
        pages = [(k // 4) * 4 for k in PREFIX_LENGTHS]
        assert cached[2] == ([0, 0, 4, 4, 8, 8, 8, 16, 16] if hybrid else pages), cached
        assert all(c > 0 for c in cached[3]), "the repeated batch hits its own pages"
        assert cached[4] == pages, f"a shared prefix hits in full the second time: {cached}"
        queries, hits = on.engine.buffers.prefix_cache_stats
        assert hits == sum(map(sum, cached)) and queries > hits > 0
        assert 0 < on.engine.prefix_cache_hit_rate < 1

    def test_prefix_caching_on_the_graph_paths(self, conformance_checkpoint: Path) -> None:
        """The rounds above on the GPU's graph paths (on the CPU their eager form: bucket-padded decode
        rows and, where the model runs prefill graphs, padded prefill steps, with their checkpoints inside
        chunks for models with state) give the uncached run's greedy tokens, and the hits' short prefill
        steps really take the prefill-graph path."""
        if not self.prefix_caching:
            pytest.skip("the model refuses prefix caching (test_prefix_caching_matches_uncached checks it)")
        base, rounds = self._prefix_rounds()
        small = ["cache.block_size=4", "cache.snapshot_interval_pages=2", "model.max_model_len=64"]
        off = self._variant(conformance_checkpoint, *small, "cache.enable_prefix_caching=false")
        expected = [[o.outputs[0].token_ids for o in r] for r in self._run_rounds(off, [[base], *rounds], 6)]
        on = self._variant(conformance_checkpoint, *small)
        executor = on.engine.executor
        if not executor.runner.model.decode_graphs:
            pytest.skip("the model's decode is not graph-safe (decode_graphs is False): no graph paths")
        executor.capture_cuda_graphs(eager=True)
        prefill = executor.runner.prefill_graphs
        steps = []
        if prefill is not None:
            run = prefill.run

            def recording_run(chunks, state_slots, checkpoints):
                steps.append((len(chunks), checkpoints is not None))
                return run(chunks, state_slots, checkpoints)

            prefill.run = recording_run
        outs = self._run_rounds(on, [[base], *rounds], 6)
        assert [[o.outputs[0].token_ids for o in r] for r in outs] == expected
        if executor.runner.model.prefill_graph_tokens:
            assert any(n > 1 for n, _ in steps), f"no prefill-graph step of several requests: {steps}"
            if on.engine.buffers.cuts_chunks:
                assert any(ckpt for _, ckpt in steps), "no prefill-graph step saved a checkpoint"

    def test_prefix_caching_under_page_pressure(self, conformance_checkpoint: Path) -> None:
        """A pool too small to keep every prefix: cached pages are evicted for new ones, requests whose
        pages are shared are preempted (their shared pages stay with the others), and the greedy tokens
        still equal an uncached run; every page comes back."""
        if not self.prefix_caching:
            pytest.skip("the model refuses prefix caching (test_prefix_caching_matches_uncached checks it)")
        base, rounds = self._prefix_rounds()
        rng = random.Random(9)
        others = [[rng.randrange(200) for _ in range(24)] for _ in range(3)]
        shared = [base[:16] + [rng.randrange(200) for _ in range(5)] for _ in range(4)]
        plan = [[base], *[[o] for o in others], [base], shared]
        pages = 12
        small = [
            "cache.block_size=4",
            "cache.snapshot_interval_pages=2",
            f"cache.num_gpu_blocks_override={pages}",
            "model.max_model_len=40",
        ]
        expected = [
            [o.outputs[0].token_ids for o in outs]
            for outs in self._run_rounds(
                self._variant(conformance_checkpoint, *small, "cache.enable_prefix_caching=false"), plan, 6
            )
        ]
        on = self._variant(conformance_checkpoint, *small)
        buffers = on.engine.buffers
        free, shared_preempted = buffers.free, []

        def recording_free(request: Any) -> None:
            table = buffers.block_table(request.request_id)
            if request.status.name == "PREEMPTED" and any(buffers.pool._refs[p] > 1 for p in table):
                shared_preempted.append(request.request_id)
            free(request)

        buffers.free = recording_free
        outs = self._run_rounds(on, plan, 6)
        assert [[o.outputs[0].token_ids for o in r] for r in outs] == expected
        assert shared_preempted, "no request holding shared pages was preempted"
        assert buffers.pool.num_evictions > 0, "the pool was large enough to evict nothing"
        assert sum(o.metrics.num_preemptions for o in outs[-1]) > 0, "nothing was preempted"
        assert any(o.num_cached_tokens for o in outs[-1]), "the shared batch hit nothing"
        assert buffers.pool.num_free == pages and buffers.num_active == 0
