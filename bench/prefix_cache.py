"""Prefix caching: time to first token with and without a hit, shared-prompt throughput, and what caching
costs when nothing hits.

    python bench/prefix_cache.py                                  # CPU, tiny Qwen3 and Qwen3.5, float32
    python bench/prefix_cache.py --arch qwen3_5 --prompt-len 2048 --intervals 8,32,128
    python bench/prefix_cache.py --shapes qwen3_14b,qwen35_9b --load-format dummy --device cuda \
        --dtype bfloat16 --prompt-len 2112 --shared-len 2048 --batch 64 --system-len 1024 --requests 64 \
        --intervals "" --out bench/results/prefix_cache.jsonl    # the H200 figures, real shapes

For each model: an engine with caching off times a ``--prompt-len`` prompt to its first token (the median
of ``--reps``), ``--decode-steps`` decode steps of ``--batch`` requests whose prompts share nothing (host
time of ``schedule()`` plus the batch's construction, and wall time per step), and a client keeping
``--concurrency`` requests in flight, each a shared ``--system-len`` system prompt and a user turn of its
own. Then an engine with caching on does the same, and also: the prompt again (a hit) and prompts sharing
``--shared-len`` tokens with it, each with its own tail (the first one, then the median of the others,
whose ratio to the uncached TTFT is the headline figure). Misses use a fresh cache salt per run. Hybrid
models also report a miss's TTFT for each ``--intervals`` snapshot interval.

Records (``--out``, JSON lines with GPU, date, commit and command) only come from ``--device cuda`` runs
with the real shapes; the CPU figures are for the host's work.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import Results, cpu_name

from pegainfer.config.compose import build_engine_config, compose
from pegainfer.engine.llm import LLM
from pegainfer.sampling.sampling_params import SamplingParams


def release(llm: LLM) -> None:
    """Shut ``llm`` down and give its device memory back before the next engine plans its own (each one
    budgets ``gpu_memory_utilization`` of the whole device)."""
    import torch

    llm.engine.shutdown()
    llm.engine = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def build(args: argparse.Namespace, folder: Path, *overrides: str) -> LLM:
    base = [f"model.path={folder}", f"device={args.device}", f"model.dtype={args.dtype}"]
    if args.load_format:
        base.append(f"model.load_format={args.load_format}")
    if args.device == "cpu":
        base.append(f"cache.cpu_kv_cache_bytes={args.cpu_kv_bytes}")
    longest = max(
        args.prompt_len + 1, 64 + args.decode_steps + 8, args.system_len + args.user_len + args.out_len
    )
    base += [
        f"model.max_model_len={longest + 16}",
        f"scheduler.max_num_seqs={max(args.batch, args.concurrency)}",
    ]
    return LLM.from_config(build_engine_config(compose("generate", [*base, *overrides])))


def ttft_ms(llm: LLM, prompt: list[int], salt: str | None = None) -> tuple[float, int, int]:
    """Wall ms of one prompt to its first token, its cached tokens and the steps it took."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    steps = engine.stats["steps"]
    t0 = time.perf_counter()
    engine.add_request(f"r{time.perf_counter_ns()}", None, params, prompt_token_ids=prompt, cache_salt=salt)
    cached = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            cached = out.num_cached_tokens
    return (time.perf_counter() - t0) * 1e3, cached, engine.stats["steps"] - steps


def median_ttft(llm: LLM, prompt: list[int], reps: int, *, miss: bool) -> tuple[float, int, int]:
    runs = [ttft_ms(llm, prompt, f"miss-{i}-{time.perf_counter_ns()}" if miss else None) for i in range(reps)]
    return statistics.median(r[0] for r in runs), runs[-1][1], runs[-1][2]


def decode_ms_per_step(llm: LLM, batch: int, prompt_len: int, steps: int) -> tuple[float, float]:
    """Median host ms (``schedule()`` + the batch's construction, where the prefix-caching bookkeeping runs)
    and median wall ms per step over ``steps`` decode steps of ``batch`` requests whose prompts share
    nothing: what caching costs when nothing hits."""
    engine = llm.engine
    spent: list[float] = []
    schedule, build_batch = engine.scheduler.schedule, engine.batches.build

    def timed_schedule():
        t0 = time.perf_counter()
        out = schedule()
        spent.append(time.perf_counter() - t0)
        return out

    def timed_build(*a: Any):
        t0 = time.perf_counter()
        out = build_batch(*a)
        spent[-1] += time.perf_counter() - t0
        return out

    engine.scheduler.schedule, engine.batches.build = timed_schedule, timed_build
    rng = random.Random(time.perf_counter_ns())
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(batch):
        engine.add_request(
            f"d{i}-{rng.random()}", None, params, prompt_token_ids=random_tokens(rng, prompt_len)
        )
    while engine.scheduler.num_waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
        engine.step()
    spent.clear()
    walls = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t0)
    if engine.scheduler.num_running != batch:
        raise RuntimeError(f"only {engine.scheduler.num_running} of {batch} requests ran every timed step")
    while engine.has_unfinished_requests():
        engine.step()
    engine.scheduler.schedule, engine.batches.build = schedule, build_batch
    return statistics.median(spent[1:-1] or spent) * 1e3, statistics.median(walls) * 1e3


def shared_prompt_throughput(
    llm: LLM,
    requests: int,
    concurrency: int,
    system: list[int],
    user_len: int,
    out_len: int,
    *,
    warm_up: bool = True,
) -> float:
    """Output tokens per second of ``requests`` requests, each ``system`` + a user turn of its own, sent by
    a client that keeps ``concurrency`` of them in flight (a new one as soon as one finishes). With
    ``warm_up`` one untimed wave of ``concurrency`` requests runs first, so the kernels its step shapes
    compile (Triton compiles per specialisation on first use) are not timed."""
    if warm_up:
        shared_prompt_throughput(llm, concurrency, concurrency, system, user_len, out_len, warm_up=False)
    engine = llm.engine
    rng = random.Random(time.perf_counter_ns())
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    sent = done = 0
    t0 = time.perf_counter()
    while done < requests:
        while sent < requests and sent - done < concurrency:
            prompt = system + random_tokens(rng, user_len)
            engine.add_request(f"t{sent}-{rng.random()}", None, params, prompt_token_ids=prompt)
            sent += 1
        done += sum(out.finished for out in engine.step())
    return requests * out_len / (time.perf_counter() - t0)


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(900) for _ in range(n)]


def gpu_shapes(names: str) -> list[tuple[str, Path]]:
    """Checkpoint folders (config.json and a tokenizer) of the benchmarks' real shapes, by name."""
    from qwen3_14b import checkpoint_folder as qwen3_folder
    from qwen35 import SHAPES
    from qwen35 import checkpoint_folder as qwen35_folder

    makers = {
        "qwen3_14b": lambda: qwen3_folder(40),
        "qwen35_9b": lambda: qwen35_folder(SHAPES["9b"]),
        "qwen35_27b": lambda: qwen35_folder(SHAPES["27b"]),
    }
    return [(name, makers[name]()) for name in names.split(",") if name]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--arch", default="qwen3,qwen3_5", help="tiny architectures (CPU, no --shapes)")
    parser.add_argument("--path", help="a checkpoint folder instead of tiny ones")
    parser.add_argument("--shapes", default="", help="real shapes instead: qwen3_14b, qwen35_9b, qwen35_27b")
    parser.add_argument("--load-format", default=None, choices=[None, "auto", "dummy"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--shared-len", type=int, default=None, help="default: 3/4 of the prompt")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument(
        "--system-len", type=int, default=256, help="the throughput run's shared system prompt"
    )
    parser.add_argument("--user-len", type=int, default=64)
    parser.add_argument("--out-len", type=int, default=32)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument(
        "--intervals", default="8,32,128", help="snapshot intervals (pages) for hybrid models"
    )
    parser.add_argument("--cpu-kv-bytes", type=int, default=256 << 20)
    parser.add_argument("--commit", default=None, help="the commit measured (default: git's HEAD)")
    parser.add_argument("--out", type=Path, default=None, help="append JSON lines here (default: print only)")
    args = parser.parse_args()
    shared_len = args.shared_len or args.prompt_len * 3 // 4
    args.prompt_len = max(args.prompt_len, args.system_len + args.user_len)
    command = "python bench/prefix_cache.py " + " ".join(sys.argv[1:])
    results = Results(args.out, command, args.commit, device=None if args.device == "cuda" else cpu_name())

    def record(model: str, figure: str, value: float, unit: str, goal: float | None = None) -> None:
        results.add(f"prefix_cache.{model}.{figure}", value, unit, goal)

    with tempfile.TemporaryDirectory() as tmp:
        if args.shapes:
            models = gpu_shapes(args.shapes)
        elif args.path:
            models = [(Path(args.path).name, Path(args.path))]
        else:
            from pegainfer.testing.checkpoints import write_tiny_checkpoint

            models = [(a, write_tiny_checkpoint(Path(tmp) / a, a)) for a in args.arch.split(",")]
        rng = random.Random(0)
        prompt = random_tokens(rng, args.prompt_len)
        tails = [random_tokens(rng, args.prompt_len - shared_len) for _ in range(args.reps + 1)]
        system = random_tokens(rng, args.system_len)
        for name, folder in models:
            off = build(args, folder, "cache.enable_prefix_caching=false")
            uncached, _, steps = median_ttft(off, prompt, args.reps, miss=True)
            record(name, "ttft_ms.uncached", uncached, "ms")
            record(name, "ttft_steps.uncached", steps, "steps")
            host_off, step_off = decode_ms_per_step(off, args.batch, 64, args.decode_steps)
            tput_off = shared_prompt_throughput(
                off, args.requests, args.concurrency, system, args.user_len, args.out_len
            )
            release(off)
            on = build(args, folder)
            hybrid = on.engine.buffers.cuts_chunks
            ms, _, steps = median_ttft(on, prompt, args.reps, miss=True)
            record(name, "ttft_ms.miss", ms, "ms")
            record(name, "ttft_steps.miss", steps, "steps")
            ttft_ms(on, prompt)  # cache it
            ms, cached, steps = median_ttft(on, prompt, args.reps, miss=False)
            record(name, "ttft_ms.hit", ms, "ms")
            record(name, "ttft_steps.hit", steps, "steps")
            # A prefix shared with the cached prompt, each run with a tail of its own: the first run finds
            # the cached pages (hybrid models: up to the last snapshot, and it snapshots where they end),
            # the later ones all of them.
            runs = [ttft_ms(on, prompt[:shared_len] + tail) for tail in tails]
            record(name, "ttft_ms.partial_hit.first", runs[0][0], "ms")
            partial = statistics.median(r[0] for r in runs[1:])
            record(name, f"ttft_ms.shared{shared_len}_hit", partial, "ms")
            record(name, "partial_hit.cached_tokens", runs[-1][1], "tokens")
            record(name, f"ttft_steps.shared{shared_len}_hit", runs[-1][2], "steps")
            record(name, f"ttft_ratio.shared{shared_len}_hit_vs_uncached", partial / uncached, "ratio", 0.15)
            host_on, step_on = decode_ms_per_step(on, args.batch, 64, args.decode_steps)
            record(name, f"host_ms_per_step.bs{args.batch}.nohit.uncached", host_off, "ms")
            record(name, f"host_ms_per_step.bs{args.batch}.nohit.cached", host_on, "ms", 1.0)
            record(name, f"decode_ms_per_step.bs{args.batch}.nohit.uncached", step_off, "ms")
            record(name, f"decode_ms_per_step.bs{args.batch}.nohit.cached", step_on, "ms")
            record(name, f"decode_ratio.bs{args.batch}.nohit.cached_vs_uncached", step_on / step_off, "ratio")
            tput_on = shared_prompt_throughput(
                on, args.requests, args.concurrency, system, args.user_len, args.out_len
            )
            figure = f"throughput.c{args.concurrency}.system{args.system_len}"
            record(name, f"{figure}.uncached", tput_off, "output tok/s")
            record(name, f"{figure}.cached", tput_on, "output tok/s")
            record(name, f"{figure}.speedup", tput_on / tput_off, "ratio")
            runner = getattr(on.engine.executor, "runner", None)
            prefill_graphs = runner is not None and runner.prefill_graphs is not None
            release(on)
            if prefill_graphs and args.device == "cuda":
                # Side by side: the same hits with the short prefill steps run eagerly.
                eager = build(args, folder, "prefill_graph_max_tokens=0")
                ttft_ms(eager, prompt)
                runs = [ttft_ms(eager, prompt[:shared_len] + tail) for tail in tails]
                ms = statistics.median(r[0] for r in runs[1:])
                record(name, f"ttft_ms.shared{shared_len}_hit.prefill_graphs_off", ms, "ms")
                record(
                    name, f"ttft_ratio.shared{shared_len}_hit.graphs_vs_eager_prefill", partial / ms, "ratio"
                )
                tput = shared_prompt_throughput(
                    eager, args.requests, args.concurrency, system, args.user_len, args.out_len
                )
                record(name, f"{figure}.cached.prefill_graphs_off", tput, "output tok/s")
                release(eager)
            if hybrid:
                for interval in [int(i) for i in args.intervals.split(",") if i]:
                    llm = build(args, folder, f"cache.snapshot_interval_pages={interval}")
                    ms, _, steps = median_ttft(llm, prompt, args.reps, miss=True)
                    record(name, f"ttft_ms.miss.interval{interval}", ms, "ms")
                    record(name, f"ttft_steps.miss.interval{interval}", steps, "steps")
                    release(llm)
    if args.out is not None:
        results.write()


if __name__ == "__main__":
    main()
