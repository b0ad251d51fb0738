"""Shared pieces of the benchmarks: the ceilings measured in the same run, timing, decode set-up, result records."""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.language as tl

from pegainfer.config.compose import build_model_config
from pegainfer.config.schema import (
    CacheConfig,
    EngineConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from pegainfer.engine.llm import LLM
from pegainfer.sampling.sampling_params import RequestOutputKind, SamplingParams


def cuda_time_ms(fn: Callable[[], object], reps: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of ``fn`` on the GPU, timed with CUDA events after warm-up."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graph_time_ms(fn: Callable[[], object], calls: int = 1, reps: int = 30) -> float:
    """Median ms per call of ``fn`` (which makes ``calls`` calls), captured and replayed as one CUDA graph:
    timed as the decode step runs its kernels, without launch gaps."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (compilation, lazy initialisation) outside the graph
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return statistics.median(times) / calls


def per_call_ms(fns: list[Callable[[], object]], reps: int = 10) -> float:
    """Median ms of one call, the calls (one per weight copy, so the weights come from HBM) replayed
    together as one CUDA graph."""
    return graph_time_ms(lambda: [fn() for fn in fns], calls=len(fns), reps=reps)


#: ``scheduler.max_num_batched_tokens`` of the engines the scripts build, unless told otherwise.
MAX_NUM_BATCHED_TOKENS = 16384


def add_memory_args(parser: argparse.ArgumentParser, utilization: float) -> None:
    """``--max-num-batched-tokens`` and ``--gpu-memory-utilization`` for a script's decode engine: lowering the
    first (its transients shrink with it) and raising the second fit a shape whose weights nearly fill
    an 80 GB card; prefill steps are then cut into chunks of that many tokens."""
    parser.add_argument("--max-num-batched-tokens", type=int, default=MAX_NUM_BATCHED_TOKENS)
    parser.add_argument("--gpu-memory-utilization", type=float, default=utilization)


def build(
    folder: Path,
    max_num_seqs: int,
    max_model_len: int,
    enforce_eager: bool = False,
    gpu_memory_utilization: float = 0.9,
    speculative_tokens: int = 0,
    speculative_method: str = "mtp",
    block_size: int | None = None,
    dtype: str = "bfloat16",
    tp: int = 1,
    model_keys: dict | None = None,
    max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS,
) -> LLM:
    """An engine on the GPU (bf16 unless ``dtype`` says otherwise) with random weights of ``folder``'s
    config.json shape (drafting ``speculative_tokens`` tokens a step with the model's own draft layers, or
    by prompt lookup with ``speculative_method="ngram"``),
    ``block_size``-token pages (None: the engine's default), over ``tp`` GPUs (rank 0 in this process:
    ``llm.engine.executor.runner`` is its shard; the engine turns NVLink multicast off in every rank);
    ``model_keys``: the model plugin's own ``model.*`` keys; ``max_num_batched_tokens`` sizes the prefill
    pass's transients, which the memory plan reserves before the pages."""
    model = {"path": str(folder), "load_format": "dummy", "dtype": dtype, "max_model_len": max_model_len}
    return LLM.from_config(
        EngineConfig(
            model=build_model_config({**model, **(model_keys or {})}),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens
            ),
            cache=CacheConfig(
                gpu_memory_utilization=gpu_memory_utilization,
                **({} if block_size is None else {"block_size": block_size}),
            ),
            speculative=SpeculativeConfig(num_tokens=speculative_tokens, method=speculative_method),
            parallel=ParallelConfig(tensor_parallel_size=tp),
            device="cuda",
            enforce_eager=enforce_eager,
        )
    )


#: Parameters (by the last part of their name) whose output is added to the residual stream.
RESIDUAL_OUTPUTS = ("o_proj", "out_proj", "down_proj", "experts_down")


def make_near_bigram(
    model: torch.nn.Module,
    *,
    draft_input: str,
    copies: dict[str, str],
    identity_norms: tuple[str, ...],
    identity: float,
    scale: float = 1e-3,
) -> None:
    """Reshape a dummy-initialised model and its draft (MTP) module, in place, into a near-bigram model
    whose drafts come out right: speculative decoding at a known high acceptance, for its speed-up.

    Embedding rows at unit RMS and every projection into the residual stream (``RESIDUAL_OUTPUTS``) times
    ``scale``: the residual stays the current token's embedding, so the next token is mostly a function of
    the current one, by margins (~0.2 of a unit-std logit between the top two of a large vocabulary) far
    above the rounding that differs between a verification chunk and a decode step. The draft module's
    input projection ``draft_input`` reads only the next token's embedding (``[I | 0]``), the norms in
    ``identity_norms`` are set to ``identity`` (1 for plain weights, 0 for zero-centred ones), and
    ``copies`` (draft parameter → main parameter) give it the main model's embedding, final norm and head:
    it then predicts ``head(norm(embed(t + 1)))``, the token the main model is about to choose. A model
    built without its draft module gets the main part only (the plain decode to compare with). Random
    weights otherwise: the parts' costs are those of the shape."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        embed = params["embed_tokens"]
        embed.copy_(embed.float() * embed.float().pow(2).mean(-1, keepdim=True).rsqrt())
        for name, param in params.items():
            if name.rsplit(".", 1)[-1] in RESIDUAL_OUTPUTS:
                param.mul_(scale)
        if draft_input not in params:
            return  # built without its draft module (no drafting)
        for draft, main in copies.items():
            params[draft].copy_(params[main])
        w = params[draft_input]
        w.zero_()
        w[:, : w.shape[0]].copy_(torch.eye(w.shape[0]))
        for name in identity_norms:
            params[name].fill_(identity)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
    )


def start_decoding(engine, prefix: str, prompts: list[list[int]], params) -> list[str]:
    """Add one request per prompt (ids ``prefix-i``), step until every one is decoding (its prompt done,
    a first token out), then three more steps; returns the ids. ``params.max_tokens`` must leave room for
    the prefill's steps and the timed ones: :func:`check_all_running` after the timing."""
    ids = [f"{prefix}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, None, params, prompt_token_ids=prompt)
    while any(r.num_output_tokens == 0 for r in engine.scheduler.running) or engine.scheduler.num_waiting:
        engine.step()
    for _ in range(3):
        engine.step()
    return ids


def timed_decode(llm, prompt: list[int], tokens: int) -> tuple[list[int], float, float]:
    """Batch-1 greedy decode of ``tokens`` tokens after ``prompt`` on ``llm``: (its token ids, decode
    tokens/s with the prompt's prefill left out (a ``max_tokens=1`` run subtracted), the speculative
    acceptance rate, NaN without drafting), after a short warm-up."""
    llm.generate(prompt_token_ids=[prompt], sampling_params=greedy(8), use_tqdm=False)
    times, out = [], None
    for n in (1, tokens):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = llm.generate(prompt_token_ids=[prompt], sampling_params=greedy(n), use_tqdm=False)[0]
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    rate = getattr(out.metrics, "spec_acceptance_rate", None)
    return (
        out.outputs[0].token_ids,
        (tokens - 1) / (times[1] - times[0]),
        float("nan") if rate is None else rate,
    )


def decode_graph_ms(engine, batch: int) -> float:
    """GPU milliseconds of one replay of the ``batch``-row decode graph alone; NaN without graphs or over
    several ranks (rank 0's graph waits in its all-reduces for the others, which only a step runs)."""
    graphs = engine.executor.runner.graphs
    if graphs is None or getattr(engine.executor, "size", 1) > 1:
        return float("nan")
    return cuda_time_ms(lambda: graphs.run(batch), reps=10)


def timed_steps_ms(engine, steps: int) -> float:
    """Wall ms per engine step over ``steps`` steps, the GPU synchronised before and after."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / steps


def stop_decoding(engine, ids: list[str]) -> None:
    """Abort the requests :func:`start_decoding` started and let the engine drop them."""
    for rid in ids:
        engine.abort_request(rid)
    engine.step()


def check_all_running(engine, batch: int) -> None:
    """Raise unless all ``batch`` requests still run: a batch that shrank during the timed steps would be
    timed as the full one."""
    if engine.scheduler.num_running != batch:
        raise RuntimeError(
            f"{batch - engine.scheduler.num_running} of {batch} requests stopped during the timed steps"
        )


@triton.jit
def _stream_read(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    # 64-bit offsets: 4 GiB of bf16 is 2^31 elements.
    pid = tl.program_id(0).to(tl.int64)
    step = tl.num_programs(0).to(tl.int64) * BLOCK
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(pid * BLOCK, n, step):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0, eviction_policy="evict_first").to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


def stream_read_bytes_per_s(gib: int = 4, reps: int = 20) -> float:
    """The decode ceiling: the best rate a read-only Triton stream reaches over ``gib`` GiB of bf16 (each
    program sums its tiles, loaded evict-first, into one float; several grid and tile sizes, best of
    ``reps`` each). A decode step only reads its weights, and a copy, which also writes, reads slower."""
    n = gib * (1 << 30) // 2
    x = torch.ones(n, device="cuda", dtype=torch.bfloat16)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    best = 0.0
    for programs in (4 * sms, 8 * sms, 16 * sms):
        out = torch.empty(programs, device="cuda", dtype=torch.float32)
        for block in (4096, 8192, 16384):
            for rep in range(3 + reps):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                _stream_read[(programs,)](x, out, n, BLOCK=block, num_warps=8)
                end.record()
                end.synchronize()
                if rep >= 3:  # after warm-up (the first launch compiles)
                    best = max(best, 2 * n / (start.elapsed_time(end) / 1e3))
            total = out.double().sum().item()  # the partials are exact integers
            if total != n:  # every element read exactly once
                raise RuntimeError(f"stream read of {programs}x{block} summed {total}, not {n}")
    return best


def measure_ceilings() -> dict[str, float]:
    """HBM copy bandwidth (1 GiB device-to-device, bytes read + written), the streaming-read rate
    (``stream_read_bytes_per_s``), the decode ceiling (the higher of the two) and the bf16 matmul rate
    (8192³)."""
    read = stream_read_bytes_per_s()
    torch.cuda.empty_cache()
    n = (1 << 30) // 2
    x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    copy_ms = cuda_time_ms(lambda: y.copy_(x), reps=20)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_ms = cuda_time_ms(lambda: a @ b, reps=10)
    copy = 2 * (1 << 30) / (copy_ms / 1e3)
    return {
        "hbm_bytes_per_s": copy,
        "hbm_read_bytes_per_s": read,
        "decode_ceiling_bytes_per_s": max(copy, read),
        "bf16_flops_per_s": 2 * 8192**3 / (mm_ms / 1e3),
    }


class Results:
    """Figures appended to ``bench/results/<benchmark>.jsonl``, one JSON object per figure."""

    def __init__(
        self, path: Path, command: str, commit: str | None = None, device: str | None = None
    ) -> None:
        self.path = path
        self.command = command
        self.commit = commit or _git_commit()
        # ``device`` names what ran the figures when it is not the GPU (the CPU benchmarks).
        self.gpu = device or torch.cuda.get_device_name()
        self.date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        self.rows: list[dict] = []

    def add(self, figure: str, value: float, unit: str, goal: float | None = None) -> None:
        row = {
            "figure": figure,
            "value": round(value, 6),
            "unit": unit,
            "goal": goal,
            "gpu": self.gpu,
            "date": self.date,
            "commit": self.commit,
            "command": self.command,
        }
        self.rows.append(row)
        print(json.dumps(row), flush=True)

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            for row in self.rows:
                f.write(json.dumps(row) + "\n")


def cpu_name() -> str:
    """The host CPU's model name, for the records of the CPU benchmarks."""
    info = Path("/proc/cpuinfo")
    for line in info.read_text().splitlines() if info.exists() else []:
        if line.startswith("model name"):
            return "CPU " + line.split(":", 1)[1].strip()
    return "CPU " + (platform.processor() or platform.machine())


def _git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        return "unknown"


def write_word_tokenizer(folder: Path, vocab_size: int) -> None:
    """Replace the test tokenizer in ``folder`` with a word-level one that has a distinct word for every
    one of ``vocab_size`` ids (its specials at the top ids), so every token a random-weight model
    generates has text: streams then carry one text chunk per token, as with a real tokenizer, and a
    serving benchmark's TTFT and ITL are measurable."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel

    specials = json.loads((folder / "tokenizer_config.json").read_text())
    names = [f"w{i}" for i in range(vocab_size)]
    tokens = {"<|endoftext|>", "<|im_start|>", "<|im_end|>", specials.get("eos_token") or "<|im_end|>"}
    for offset, special in enumerate(sorted(tokens)):
        names[vocab_size - 1 - offset] = special
    tokenizer = Tokenizer(WordLevel({name: i for i, name in enumerate(names)}, unk_token=names[0]))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(sorted(tokens))
    tokenizer.save(str(folder / "tokenizer.json"))
