"""Prefix caching: time to first token with and without a hit, and the scheduler's host time per step.

    python bench/prefix_cache.py                                  # CPU, tiny Qwen3 and Qwen3.5, float32
    python bench/prefix_cache.py --arch qwen3_5 --prompt-len 2048 --intervals 8,32,128
    python bench/prefix_cache.py --path /ckpt/Qwen3.5-4B --load-format dummy --device cuda --dtype bfloat16 \
        --prompt-len 4096 --out bench/results/prefix_cache.jsonl     # a GPU run, real shapes

For each model: a fresh engine runs a ``--prompt-len`` prompt (one token out) with caching off, then with
caching on (a miss: what caching costs a prompt, e.g. its hashing and, for hybrid models, the chunks cut at
snapshot boundaries), then the same prompt again (a hit), and prompts sharing ``--shared-len`` tokens with
it, each with its own tail (partial hits: the first one, then the others). Each TTFT is the median of ``--reps`` runs, each from an engine state where the
prefix is cached (hits) or cached nowhere (misses: a fresh salt per run). Then ``--batch`` requests decode
``--decode-steps`` steps with caching off and on: the host time of ``schedule()`` plus the batch's
construction per step (the prefix-caching bookkeeping runs there). Hybrid models also report the prefill
steps a miss takes for each ``--intervals`` snapshot interval.

Nothing is written unless ``--out`` is given (JSON lines, one figure each). On a GPU only the times are
meaningful with ``--load-format dummy`` and the real shapes; the CPU figures are for the host's work.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

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
    base.append(f"model.max_model_len={args.prompt_len + args.decode_steps + 8}")
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


def host_ms_per_step(llm: LLM, batch: int, prompt_len: int, steps: int) -> float:
    """Median ms of ``schedule()`` + the batch's construction over decode steps of ``batch`` requests."""
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
    rng = random.Random(1)
    shared = [rng.randrange(900) for _ in range(prompt_len)]
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    for i in range(batch):  # a shared prefix and a tail of their own: the usual serving mix
        engine.add_request(f"d{i}", None, params, prompt_token_ids=shared + [i % 900, 7])
    while engine.scheduler.num_waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
    ):
        engine.step()
    spent.clear()
    while engine.has_unfinished_requests():
        engine.step()
    engine.scheduler.schedule, engine.batches.build = schedule, build_batch
    return statistics.median(spent[1:-1] or spent) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--arch", default="qwen3,qwen3_5", help="tiny architectures (without --path)")
    parser.add_argument("--path", help="a checkpoint folder instead of tiny ones")
    parser.add_argument("--load-format", default=None, choices=[None, "auto", "dummy"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--shared-len", type=int, default=None, help="default: 3/4 of the prompt")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument(
        "--intervals", default="8,32,128", help="snapshot intervals (pages) for hybrid models"
    )
    parser.add_argument("--cpu-kv-bytes", type=int, default=256 << 20)
    parser.add_argument("--out", type=Path, default=None, help="append JSON lines here (default: print only)")
    args = parser.parse_args()
    shared_len = args.shared_len or args.prompt_len * 3 // 4
    records: list[dict[str, Any]] = []

    def record(model: str, figure: str, value: float, **extra: Any) -> None:
        records.append({"figure": f"prefix_cache.{model}.{figure}", "value": round(value, 4), **extra})
        print(f"{model:>10} {figure:<34} {value:10.3f} {extra or ''}")

    with tempfile.TemporaryDirectory() as tmp:
        if args.path:
            models = [(Path(args.path).name, Path(args.path))]
        else:
            from pegainfer.testing.checkpoints import write_tiny_checkpoint

            models = [(a, write_tiny_checkpoint(Path(tmp) / a, a)) for a in args.arch.split(",")]
        rng = random.Random(0)
        prompt = [rng.randrange(900) for _ in range(args.prompt_len)]
        tails = [
            [rng.randrange(900) for _ in range(args.prompt_len - shared_len)] for _ in range(args.reps + 1)
        ]
        for name, folder in models:
            off = build(args, folder, "cache.enable_prefix_caching=false")
            ms, _, steps = median_ttft(off, prompt, args.reps, miss=True)
            record(name, "ttft_ms.uncached", ms, steps=steps)
            record(
                name, "host_ms_per_step.uncached", host_ms_per_step(off, args.batch, 64, args.decode_steps)
            )
            release(off)
            on = build(args, folder)
            hybrid = on.engine.buffers.cuts_chunks
            ms, _, steps = median_ttft(on, prompt, args.reps, miss=True)
            record(name, "ttft_ms.miss", ms, steps=steps)
            ttft_ms(on, prompt)  # cache it
            ms, cached, steps = median_ttft(on, prompt, args.reps, miss=False)
            record(name, "ttft_ms.hit", ms, cached=cached, steps=steps)
            # A prefix shared with the cached prompt, each run with a tail of its own: the first run finds
            # the cached pages (hybrid models: up to the last snapshot, and it snapshots where they end),
            # the later ones all of them.
            runs = [ttft_ms(on, prompt[:shared_len] + tail) for tail in tails]
            record(name, "ttft_ms.partial_hit.first", runs[0][0], cached=runs[0][1], steps=runs[0][2])
            record(
                name,
                "ttft_ms.partial_hit",
                statistics.median(r[0] for r in runs[1:]),
                cached=runs[-1][1],
                steps=runs[-1][2],
                shared=shared_len,
            )
            record(name, "host_ms_per_step.cached", host_ms_per_step(on, args.batch, 64, args.decode_steps))
            release(on)
            if hybrid:
                for interval in [int(i) for i in args.intervals.split(",") if i]:
                    llm = build(args, folder, f"cache.snapshot_interval_pages={interval}")
                    ms, _, steps = median_ttft(llm, prompt, args.reps, miss=True)
                    record(name, f"ttft_ms.miss.interval{interval}", ms, steps=steps)
                    release(llm)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        meta = {
            "device": args.device,
            "dtype": args.dtype,
            "prompt_len": args.prompt_len,
            "time": time.time(),
        }
        with args.out.open("a") as f:
            for r in records:
                f.write(json.dumps({**r, **meta}) + "\n")


if __name__ == "__main__":
    main()
