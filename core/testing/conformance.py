"""Checks a model plugin (ours or a third party's) runs against its reference: HF transformers.

Each helper loads what it needs lazily, so importing this module does not import transformers.
"""

from __future__ import annotations

import copy
import inspect
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from pegainfer.config.schema import EngineConfig, ModelConfig, SpeculativeConfig
from pegainfer.model.checkpoint import CheckpointReader
from pegainfer.sampling.sampling_params import SamplingParams


@lru_cache(maxsize=8)
def hf_model(folder: str, dtype: torch.dtype = torch.float32, device: str = "cpu") -> Any:
    """The transformers implementation of the checkpoint in ``folder``, in eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device)
    return model.eval()


def random_prompts(seed: int, lengths: Sequence[int], vocab: int = 990) -> list[list[int]]:
    """Reproducible random token-id prompts of the given lengths (ids below ``vocab``)."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def greedy_token_ids(
    llm: Any, prompts: Sequence[Sequence[int]], params: SamplingParams | None = None
) -> list[list[int]]:
    """Our generated token ids for each prompt (greedy, 24 tokens, EOS ignored unless ``params`` says)."""
    params = params or SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=[list(p) for p in prompts], sampling_params=params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def hf_greedy(
    folder: str | Path,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    dtype: torch.dtype = torch.float32,
) -> list[list[int]]:
    """Greedy continuations from transformers, one prompt at a time, with its KV cache and no stopping.

    A plain argmax loop rather than ``generate``: ``generate``'s ``min_new_tokens`` would suppress EOS
    tokens, which our ``ignore_eos`` (like vLLM's) does not, so the two could disagree on a correct model.
    """
    model = hf_model(str(folder), dtype)
    # transformers >= 5.24 names the cache argument ``cache`` (``past_key_values`` is deprecated).
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([list(prompt)], device=model.device)
            result = model(ids, use_cache=True)
            tokens: list[int] = []
            while True:
                token = result.logits[0, -1].argmax().item()
                tokens.append(token)
                if len(tokens) == max_new_tokens:
                    break
                next_ids = torch.tensor([[token]], device=model.device)
                cache = getattr(result, "cache", None) or result.past_key_values
                result = model(next_ids, use_cache=True, **{cache_kw: cache})
            out.append(tokens)
    return out


def hf_logits(
    folder: str | Path, prompt: Sequence[int], dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> torch.Tensor:
    """Logits ``[len(prompt), V]`` (float32) of one teacher-forced forward."""
    model = hf_model(str(folder), dtype, device)
    with torch.no_grad():
        return model(torch.tensor([list(prompt)], device=device)).logits[0].float()


def teacher_forced_logits(llm: Any, tokens: Sequence[int], prefill: int) -> torch.Tensor:
    """Our logits ``[len(tokens), V]`` for ``tokens`` fed as one request: the first ``prefill`` positions
    in one chunk (every position's logits), then the rest one decode step each through the paged cache (the
    step's logits). Runs straight on the executor, with the request's pages and state slot from the
    engine's buffer manager; ``tokens`` are the model's inputs, not its samples (teacher forcing)."""
    from pegainfer.engine.request import Request
    from pegainfer.executor.model_batch import ModelBatch, SequenceChunk

    engine, tokens = llm.engine, list(tokens)
    request = Request("teacher-forced", tokens, SamplingParams(max_tokens=1))
    buffers = engine.buffers
    if not buffers.allocate_slots(request, len(tokens)):
        raise RuntimeError("no room for the teacher-forced request")
    try:
        rows = []
        for start, end in [(0, prefill), *((p, p + 1) for p in range(prefill, len(tokens)))]:
            chunk = SequenceChunk(
                request.request_id,
                tokens[start:end],
                start,
                buffers.block_table(request.request_id),
                buffers.state_slot(request.request_id),
                needs_logits=True,
                all_logits=end - start > 1,
                serial=request.serial,
            )
            out = engine.executor.execute(ModelBatch([chunk]))
            # A copy: a decode graph's logits are its static output, rewritten by the next replay.
            rows.append((out.all_logits[request.request_id] if chunk.all_logits else out.logits).clone())
        return torch.cat(rows).float()
    finally:
        buffers.free(request)


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """``||ours - ref|| / ||ref||``: the logits tolerance the equivalence tests state."""
    ours, ref = ours.cpu(), ref.cpu()  # ours may come from a GPU engine, transformers' from the CPU
    return (torch.linalg.vector_norm(ours - ref) / torch.linalg.vector_norm(ref)).item()


def top_logprob_gaps(candidate: torch.Tensor, reference: torch.Tensor, k: int = 8) -> torch.Tensor:
    """|log-prob difference| on each row's ``k`` most likely tokens under ``reference`` (both [T, V])."""
    candidate = torch.log_softmax(candidate.float(), -1)
    reference = torch.log_softmax(reference.float(), -1)
    top = reference.topk(k, dim=-1).indices
    return (candidate.gather(-1, top) - reference.gather(-1, top)).abs().flatten()


class Bf16AccuracyReport:
    """Teacher-forced bf16 accuracy against the truth (GPU tests): transformers in float32 on the same
    bf16 weights. Random weights make a chaotic network in which two correct bf16 implementations differ
    by more than on a trained model, so the gate is relative: our bf16 must be as close to the truth as
    transformers' own bf16 (within 25% + 0.01 nats, mean |delta log-prob| of the top-8 tokens)."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = folder
        self._gaps: list[torch.Tensor] = []

    def add(self, prompt: list[int], ours: torch.Tensor) -> None:
        """``ours``: logits [n, V] of the last ``n`` positions of the teacher-forced ``prompt``."""
        truth = hf_logits(self.folder, prompt, dtype=torch.float32, device=str(ours.device))
        hf16 = hf_logits(self.folder, prompt, dtype=torch.bfloat16, device=str(ours.device))
        n = ours.shape[0]
        self._gaps.append(
            torch.stack(
                [
                    top_logprob_gaps(ours, truth[-n:]),
                    top_logprob_gaps(hf16[-n:], truth[-n:]),
                    top_logprob_gaps(ours, hf16[-n:]),
                ]
            )
        )

    def add_greedy_decode(self, engine: Any, prompts: list[list[int]], max_tokens: int = 48) -> None:
        """Decode ``prompts`` greedily as one batch through ``engine`` (request ids "0", "1", ...), keeping
        the logits of every sampled row, and add each sequence's positions from its last prompt token on."""
        captured: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(prompts))}
        execute = engine.executor.execute

        def recording_execute(batch: Any) -> Any:
            out = execute(batch)
            rows = [c for c in batch.chunks if c.needs_logits]
            for chunk, logits in zip(rows, out.logits, strict=True):
                captured[int(chunk.request_id)].append(logits.clone())
            return out

        engine.executor.execute = recording_execute
        try:
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            for i, prompt in enumerate(prompts):
                engine.add_request(str(i), None, params, prompt_token_ids=prompt)
            finals = {}
            while engine.has_unfinished_requests():
                for out in engine.step():
                    finals[int(out.request_id)] = out.outputs[0].token_ids
        finally:
            engine.executor.execute = execute
        for i, prompt in enumerate(prompts):
            # logits at positions len(prompt) - 1 ... len(prompt) + max_tokens - 2
            self.add(prompt + finals[i][:-1], torch.stack(captured[i]))

    def assert_as_accurate_as_hf(self, label: str) -> None:
        gaps = torch.cat(self._gaps, dim=1)
        ours, hf, direct = gaps.mean(dim=1).tolist()
        p99, direct_p99 = gaps[0].quantile(0.99).item(), gaps[2].quantile(0.99).item()
        print(
            f"{label}: ours-vs-fp32 {ours:.4f} (p99 {p99:.4f}), hf-bf16-vs-fp32 {hf:.4f}, "
            f"ours-vs-hf-bf16 {direct:.4f} (p99 {direct_p99:.4f}), positions {gaps.shape[1] // 8}"
        )
        assert ours <= 1.25 * hf + 0.01, f"{label}: our bf16 is less accurate than transformers' bf16"


def unused_checkpoint_tensors(folder: str | Path, name: str = "auto") -> list[str]:
    """Tensors of the checkpoint that the plugin's loader never read (an empty list is full coverage), with
    drafting on, so a model's draft modules are built and read too."""
    from pegainfer.model.model_loader import load_model

    config = EngineConfig(
        model=ModelConfig(name=name, path=str(folder)),
        device="cpu",
        speculative=SpeculativeConfig(num_tokens=1),
    )
    loaded = load_model(config)
    reader = CheckpointReader(folder)
    loaded.model.load_weights(reader)
    return reader.unused()


def assert_prefill_graphs_match_eager(folder: str | Path, **options: Any) -> None:
    """On a GPU: prefix-cache hits (a long prompt, then prompts sharing 17..290 of its tokens with short
    tails, one batch whose tails run in the same steps, then that batch again) whose short prefill steps
    replay from CUDA graphs give the greedy tokens of ``enforce_eager`` (the same padded forwards without
    graphs), and the prefill graphs really ran. ``options``: the LLM's, over bf16 on CUDA at 30% of its
    memory in 16-token pages (the shared prefixes' tails fit the prefill graphs at that page size; at
    DeepSeek's default 64 they do not, seen on an H100)."""
    from pegainfer.engine.llm import LLM

    options = {
        "dtype": "bfloat16",
        "device": "cuda",
        "gpu_memory_utilization": 0.3,
        "max_model_len": 512,
        "max_num_seqs": 16,
        "block_size": 16,
        **options,
    }

    rng = random.Random(6)
    base = [rng.randrange(990) for _ in range(300)]
    shared = [
        base[:k] + [rng.randrange(990) for _ in range(n)] for k, n in ((290, 5), (150, 30), (64, 60), (17, 3))
    ]
    rounds = [[base], shared, shared]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def tokens(llm: Any) -> list[list[list[int]]]:
        outs = [llm.generate(prompt_token_ids=r, sampling_params=params, use_tqdm=False) for r in rounds]
        llm.engine.buffers.check_invariants()
        assert any(o.num_cached_tokens for o in outs[1]), "the shared prompts hit no cached prefix"
        return [[o.outputs[0].token_ids for o in r] for r in outs]

    graph_llm = LLM(str(folder), **options)
    graphs = graph_llm.engine.executor.runner.prefill_graphs
    assert graph_llm.engine.executor.capabilities.cuda_graphs and graphs is not None
    run, replays = graphs.run, [0]

    def counting(*args: Any) -> Any:
        replays[0] += 1
        return run(*args)

    graphs.run = counting
    try:
        expected = tokens(graph_llm)
        assert replays[0] > 0, "no prefill step replayed a graph"
    finally:  # the next engine (and a failing test's next case) needs the memory back
        graph_llm.engine.shutdown()
        del graph_llm, graphs
        torch.cuda.empty_cache()
    eager_llm = LLM(str(folder), enforce_eager=True, **options)
    try:
        assert tokens(eager_llm) == expected
    finally:
        eager_llm.engine.shutdown()


def _tp_llm(folder: str | Path, tp: int, **options: Any) -> Any:
    """An engine of ``tp`` ranks whose ``carried_steps[0]`` counts the steps that took a token from the
    device (scheduled ahead of the last step's read-back)."""
    from pegainfer.engine.llm import LLM

    # 16-token pages whatever the model's default: the batch's 17-token prompt has a full page to hit.
    base = dict(
        dtype="float32", device="cpu", cpu_kv_cache_bytes=8 << 20, tensor_parallel_size=tp, block_size=16
    )
    llm = LLM(str(folder), **{**base, **options})
    executor = llm.engine.executor
    execute, llm.carried_steps = executor.execute, [0]

    def counting(batch: Any) -> Any:
        llm.carried_steps[0] += any(c.carry_from >= 0 for c in batch.chunks)
        return execute(batch)

    executor.execute = counting
    return llm


def assert_tensor_parallel_matches(
    folder: str | Path,
    *,
    tp: int = 2,
    async_scheduling: bool = False,
    speculative_num_tokens: int = 0,
    max_tokens: int = 12,
    pages: int = 14,
    reference: str | Path | None = None,
) -> None:
    """A ``tp``-rank run of the checkpoint in ``folder`` (float32, CPU, gloo) against transformers (on
    ``reference``, the same weights in a layout transformers loads; default ``folder``) and against one
    rank, through two engines of ``tp`` ranks:

    - default memory: one prompt alone, then a batch of mixed lengths: greedy tokens equal to
      transformers'; logprobs (top 3) and seeded sampling equal to a one-rank engine's (logprobs within
      1e-4); with ``speculative_num_tokens`` every greedy run drafts (the tokens stay transformers');
    - the batch again, with prefix caching (unless the model refuses it): a cached prefix is hit, the
      tokens are transformers';
    - ``pages`` 4-token pages, chunks of at most 5 tokens in 12-token steps, the decode-graph path
      (eager buckets): the batch preempts (a preempted request then resumes from its cached pages),
      prefills in chunks and still gives transformers' tokens, and every page and slot comes back.

    Both engines schedule ahead when ``async_scheduling`` is set (the first on the plain decode path).
    """
    from pegainfer.sampling.sampling_params import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    single, batch = random_prompts(11, [13]), random_prompts(12, [5, 17, 1, 9])
    expected_single, expected_batch = (
        hf_greedy(reference or folder, single, max_tokens),
        hf_greedy(reference or folder, batch, max_tokens),
    )
    one = _tp_llm(folder, 1)
    llm = _tp_llm(
        folder, tp, speculative_num_tokens=speculative_num_tokens, async_scheduling=async_scheduling
    )
    try:
        assert greedy_token_ids(llm, single, greedy) == expected_single, (
            "tp: one prompt differs from transformers"
        )
        assert greedy_token_ids(llm, batch, greedy) == expected_batch, (
            "tp: the batch differs from transformers"
        )
        checks = [
            SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, ignore_eos=True),
            SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=max_tokens, ignore_eos=True),
        ]
        for params in checks:
            ours = llm.generate(prompt_token_ids=batch, sampling_params=params, use_tqdm=False)
            ref = one.generate(prompt_token_ids=batch, sampling_params=params, use_tqdm=False)
            for a, b in zip(ours, ref, strict=True):
                assert a.outputs[0].token_ids == b.outputs[0].token_ids, f"tp: {params} differs from one rank"
                for lp_a, lp_b in zip(a.outputs[0].logprobs or [], b.outputs[0].logprobs or [], strict=True):
                    assert lp_a.keys() == lp_b.keys()
                    assert all(abs(lp_a[t].logprob - lp_b[t].logprob) < 1e-4 for t in lp_a)
        llm.engine.buffers.check_invariants()
        assert (llm.carried_steps[0] > 0) == async_scheduling, "tp: async scheduling did not schedule ahead"
        # Prefix caching (on unless the model refuses it): the batch again hits its cached pages (and, for
        # recurrent state, the snapshots every rank restores from its own shard).
        again = llm.generate(prompt_token_ids=batch, sampling_params=greedy, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == expected_batch, "tp: a cached prefix differs"
        if llm.engine.buffers.caching:
            assert any(o.num_cached_tokens for o in again), "tp: the repeated batch hit no cached prefix"
        llm.engine.buffers.check_invariants()
    finally:
        llm.engine.shutdown()
    small = _tp_llm(
        folder,
        tp,
        block_size=4,
        num_gpu_blocks_override=pages,
        max_model_len=32,
        long_prefill_token_threshold=5,
        max_num_batched_tokens=12,
        async_scheduling=async_scheduling,
    )
    try:
        if async_scheduling:
            small.engine.executor.capture_cuda_graphs(eager=True)
        outs = small.generate(prompt_token_ids=batch, sampling_params=greedy, use_tqdm=False)
        assert sum(o.metrics.num_preemptions for o in outs) > 0, (
            "tp: the pool was large enough to preempt nothing"
        )
        assert [o.outputs[0].token_ids for o in outs] == expected_batch, "tp: the preempted batch differs"
        small.engine.buffers.check_invariants()
        assert small.engine.buffers.pool.num_free == pages
        assert (small.carried_steps[0] > 0) == async_scheduling, "tp: async scheduling did not schedule ahead"
    finally:
        small.engine.shutdown()


# ------------------------------------------------------------------------------------ logits vs transformers


def teacher_forced_errors(
    llm: Any, reference: str | Path, *, prompt_len: int = 21, total_len: int = 30
) -> tuple[float, float]:
    """(prefill, decode) relative L2 errors of our teacher-forced logits against transformers' on the
    checkpoint in ``reference``: a ``prompt_len``-token prompt in one chunk, then one decode step each
    through the paged cache up to ``total_len`` tokens (the suite's logits check)."""
    tokens = random_prompts(prompt_len, [total_len], vocab=200)[0]
    ours = teacher_forced_logits(llm, tokens, prefill=prompt_len)
    ref = hf_logits(reference, tokens)
    return (
        relative_error(ours[:prompt_len], ref[:prompt_len]),
        relative_error(ours[prompt_len:], ref[prompt_len:]),
    )


def conformance_engine(model_name: str, folder: str | Path, *overrides: str) -> Any:
    """An LLM of ``model_name`` on ``folder``, on the CPU in float32, built through the Hydra config like
    the suite's ``conformance_llm`` fixture (``overrides``: more Hydra overrides)."""
    from pegainfer.config.compose import build_engine_config, compose
    from pegainfer.engine.llm import LLM

    base = [
        f"model={model_name}",
        f"model.path={folder}",
        "device=cpu",
        "model.dtype=float32",
        "cache.cpu_kv_cache_bytes=8388608",
    ]
    return LLM.from_config(build_engine_config(compose("generate", [*base, *overrides])))


# ------------------------------------------------------------------------------------ mutations on purpose


@dataclass(frozen=True)
class Mutation:
    """A loader bug made on purpose, to show the logits check catches it.

    ``config`` edits (in place) the config.json the loader reads, not the one transformers reads:
    :func:`forget` drops keys, i.e. a loader that ignores them and takes its default. ``model`` edits the
    loaded model in place (e.g. an attention scale 1% off)."""

    name: str
    config: Callable[[dict[str, Any]], None] | None = None
    model: Callable[[Any], None] | None = None

    def __str__(self) -> str:
        return self.name


def forget(*keys: str) -> Callable[[dict[str, Any]], None]:
    """A config edit that deletes each of ``keys``: a plain name wherever it is in the config (the top
    level, ``text_config``, ``rope_parameters``, ``rope_scaling``, nested ropes), a dotted path
    (``"rope_parameters.main.rope_theta"``) only there. The loader's default then stands in, as in a loader
    that never read the key."""

    def drop_everywhere(config: dict[str, Any], key: str) -> None:
        config.pop(key, None)
        for value in config.values():
            if isinstance(value, dict):
                drop_everywhere(value, key)

    def edit(config: dict[str, Any]) -> None:
        for key in keys:
            *path, name = key.split(".")
            if not path:
                drop_everywhere(config, name)
                continue
            section = config
            for part in path:
                section = section.get(part) or {}
            section.pop(name, None)

    return edit


def mutated_engine(model_name: str, folder: str | Path, mutation: Mutation, workdir: str | Path) -> Any:
    """An engine (as :func:`conformance_engine`) with ``mutation`` applied: its config edit to a copy of
    the checkpoint in ``workdir`` (weights linked, config.json rewritten), its model edit to the loaded
    model. The config edit must change the config (a key that is not there mutates nothing)."""
    folder = Path(folder)
    if mutation.config is not None:
        config = json.loads((folder / "config.json").read_text())
        edited = copy.deepcopy(config)
        mutation.config(edited)
        if edited == config:
            raise ValueError(f"mutation {mutation.name!r} leaves config.json as it is")
        copy_folder = Path(workdir) / f"mutated-{mutation.name}"
        copy_folder.mkdir(parents=True)
        for path in folder.iterdir():
            if path.name != "config.json":
                (copy_folder / path.name).symlink_to(path.resolve())
        (copy_folder / "config.json").write_text(json.dumps(edited, indent=2))
        folder = copy_folder
    llm = conformance_engine(model_name, folder)
    if mutation.model is not None:
        with torch.no_grad():
            mutation.model(llm.engine.executor.runner.model)
    return llm


def mutation_errors(
    model_name: str,
    folder: str | Path,
    mutation: Mutation,
    workdir: str | Path,
    reference: str | Path | None = None,
) -> tuple[float, float]:
    """(prefill, decode) errors of the suite's logits check (:func:`teacher_forced_errors`) for the model
    with ``mutation`` applied, against transformers on the unmutated checkpoint (``reference``, default
    ``folder``). A mutation the check catches has both above the suite's ``logits_tolerance``."""
    llm = mutated_engine(model_name, folder, mutation, workdir)
    try:
        return teacher_forced_errors(llm, reference or folder)
    finally:
        llm.engine.shutdown()


def relabelled_checkpoint(
    folder: str | Path,
    target: str | Path,
    architecture: str,
    model_type: str,
    edit: Callable[[dict[str, Any]], None] | None = None,
) -> Path:
    """``folder`` copied to ``target`` (weights, tokenizer files) with config.json's ``architectures`` and
    ``model_type`` relabelled, then ``edit`` applied to it: what transformers loads as the reference of a
    plugin architecture that shares the layout of one transformers knows (``PluginConformance
    .reference_checkpoint``). Written once: an existing ``target`` is returned as it is."""
    import shutil

    folder, target = Path(folder), Path(target)
    if not (target / "config.json").exists():
        shutil.copytree(folder, target, dirs_exist_ok=True)
        config = json.loads((folder / "config.json").read_text())
        config.update(architectures=[architecture], model_type=model_type)
        if edit is not None:
            edit(config)
        (target / "config.json").write_text(json.dumps(config, indent=2))
    return target
