"""The engine's host work per decode step, measured on the CPU: schedule, batch construction, decode-row
upload, sampling bookkeeping, detokenizing and outputs, with the model's forward excluded.

    python bench/host_overhead.py                 # bs1 and bs64, async scheduling on and off
    python bench/host_overhead.py --profile 64    # plus a cProfile table of the bs64 async steps
    python bench/host_overhead.py --count-ops     # plus the aten ops per step, by issuing line

A tiny random Qwen3 (the qwen3_14b plugin, float32; ``--model qwen35``: a tiny Qwen3.5, whose rows also
carry state slots) runs ``batch`` greedy ``ignore_eos`` requests with
FINAL_ONLY outputs, as ``bench/qwen3_14b.py``'s ``bench_decode`` does on the GPU; every timed step is one
decode step of all of them. By default the executor takes the GPU's decode path: persistent decode rows
and bucket padding through ``capture_cuda_graphs(eager=True)`` (what ``enforce_eager`` runs), so
``prepare`` and ``pad_rows`` are measured; ``--no-graph-path`` times the plain eager executor instead.
What a GPU runs inside the decode graph (the carried tokens' gather, the model, ``compute_logits``, the
greedy argmax) is timed and subtracted:

    host_ms = step wall time - forward time

(with ``--no-graph-path`` the forward is the model's forward and ``compute_logits``, timed by hooks). On the
CPU nothing waits for a device, so the GPU benchmark's waits have no counterpart here (its graph launch is
the forward here). What a GPU would launch as a kernel outside the graph (small copies, the sampler's
argmax off the graph path) runs here and stays in host_ms. The figures are medians over the timed steps.
The tiny tokenizer decodes every id, so detokenizing costs its real price.

The forward running on the same core evicts the host's data from the CPU caches every step, which a GPU
host does not suffer; ``--no-forward`` has the timed steps' decode forward return stored random logits
instead (figures ``qwen3_14b.host_cpu_noforward...``), the host's work with warm caches.

Figures are appended to ``bench/results/host_overhead.jsonl``: ``qwen3_14b.host_cpu.bs{B}.host_ms`` (async
scheduling on) and ``qwen3_14b.host_cpu_sync.bs{B}.host_ms`` (off), with ``step_ms`` and ``forward_ms``
(``qwen35.`` the same with ``--model qwen35``).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import itertools
import os
import pstats
import random
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
from common import Results, check_all_running, cpu_name, start_decoding
from torch.utils._python_dispatch import TorchDispatchMode

from pegainfer.engine.llm import LLM
from pegainfer.sampling.sampling_params import RequestOutputKind, SamplingParams
from pegainfer.testing.checkpoints import write_tiny_checkpoint

#: ``--model``: the figure prefix and the tiny checkpoint's architecture (the qwen3_14b or qwen35 plugin).
MODELS = {"qwen3_14b": "qwen3", "qwen35": "qwen3_5"}


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while active (on a GPU each is a host-side dispatch, most of them a
    launch or a copy): in total, by op, and by the engine source line that issued it. ``paused`` > 0
    (inside the model's forward: one graph replay on a GPU) stops counting."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0
        self.sites: collections.Counter[str] = collections.Counter()
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.total += 1
            frames = [f for f in traceback.extract_stack()[:-1] if f"{os.sep}core{os.sep}" in f.filename]
            where = f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else "?"
            self.sites[f"{func} at {where}"] += 1
        return func(*args, **(kwargs or {}))


class ForwardTimer:
    """Seconds spent in what a GPU runs inside the decode graph (``DecodeGraphs._forward``, wrapped) or,
    off the graph path, in the model's forward and ``compute_logits`` (pre/post hooks and a wrapper); a
    ``profiler`` or ``ops`` counter set here is paused inside them, so they hold the host's work only.
    Nested timed calls count once."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.seconds = 0.0
        self._t0 = 0.0
        self._depth = 0
        self.profiler: cProfile.Profile | None = None
        self.ops: OpCounter | None = None
        model.register_forward_pre_hook(self._start)
        model.register_forward_hook(self._stop)
        model.compute_logits = self.timed(model.compute_logits)

    def timed(self, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def run(*args: object) -> torch.Tensor:
            self._start()
            try:
                return fn(*args)
            finally:
                self._stop()

        return run

    def _start(self, *_: object) -> None:
        self._depth += 1
        if self._depth > 1:
            return
        if self.profiler:
            self.profiler.disable()
        if self.ops:
            self.ops.paused += 1
        self._t0 = time.perf_counter()

    def _stop(self, *_: object) -> None:
        self._depth -= 1
        if self._depth:
            return
        self.seconds += time.perf_counter() - self._t0
        if self.ops:
            self.ops.paused -= 1
        if self.profiler:
            self.profiler.enable()


def build(folder: Path, max_num_seqs: int, max_model_len: int, graph_path: bool) -> LLM:
    llm = LLM(
        str(folder),
        dtype="float32",
        device="cpu",
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=16384,
        max_model_len=max_model_len,
        cpu_kv_cache_bytes=256 << 20,
        async_scheduling=True,
    )
    if graph_path:
        llm.engine.executor.capture_cuda_graphs(eager=True)
    return llm


def bench_host(
    llm: LLM,
    timer: ForwardTimer,
    batch: int,
    ctx: int,
    steps: int,
    rng: random.Random,
    async_scheduling: bool,
    profile: bool = False,
    no_forward: bool = False,
    count_ops: bool = False,
) -> dict[str, float]:
    """Median wall, forward and host milliseconds of ``steps`` decode steps of ``batch`` requests; with
    ``no_forward`` the timed steps' decode forward returns stored random logits instead of running."""
    engine = llm.engine
    engine.async_scheduling = async_scheduling
    vocab = engine.executor.runner.model.vocab_size
    params = SamplingParams(
        temperature=0, max_tokens=steps + 16, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
    )
    prompts = [[rng.randrange(1, vocab) for _ in range(ctx)] for _ in range(batch)]
    ids = start_decoding(engine, f"h{batch}", prompts, params)
    graphs = engine.executor.runner.graphs
    timed_forward = graphs._forward if graphs is not None else None
    if no_forward:
        bank = torch.randn(16, graphs.max_batch, vocab, generator=torch.Generator().manual_seed(batch))
        greedy = bank.argmax(dim=-1)  # what the graph leaves in decode.sampled with these logits
        calls = itertools.count()

        def stored_logits(size: int) -> torch.Tensor:
            i = next(calls) % 16
            graphs.decode.sampled[:size] = greedy[i, :size]
            return bank[i, :size]

        graphs._forward = stored_logits
    wall, forward, host = [], [], []
    profiler = timer.profiler = cProfile.Profile() if profile else None
    ops = timer.ops = OpCounter() if count_ops else None
    if ops:
        ops.__enter__()
    for _ in range(steps):
        f0 = timer.seconds
        t0 = time.perf_counter()
        if profiler:
            profiler.enable()
        engine.step()
        dt = time.perf_counter() - t0
        if profiler:
            profiler.disable()
        fwd = timer.seconds - f0
        wall.append(dt * 1e3)
        forward.append(fwd * 1e3)
        host.append((dt - fwd) * 1e3)
    if ops:
        ops.__exit__(None, None, None)
        print(
            f"bs{batch} async {'on' if async_scheduling else 'off'}: {ops.total / steps:.1f} aten ops per step"
        )
        for site, n in ops.sites.most_common(12):
            print(f"  {n / steps:6.1f}  {site}")
        timer.ops = None
    if no_forward:
        graphs._forward = timed_forward
    check_all_running(engine, batch)
    for rid in ids:
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    timer.profiler = None
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
    median = statistics.median
    figures = {
        "step_ms": median(wall),
        "forward_ms": median(forward),
        "host_ms": median(host),
    }
    if ops:
        figures["aten_ops"] = ops.total / steps
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "host_overhead.jsonl")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--ctx", type=int, default=256, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=100, help="timed decode steps per run")
    parser.add_argument("--sync", default="1,64", help="also time these batches with async scheduling off")
    parser.add_argument("--no-graph-path", dest="graph_path", action="store_false")
    parser.add_argument(
        "--no-forward",
        action="store_true",
        help="timed decode steps skip the model (stored logits): the host's work with warm caches",
    )
    parser.add_argument("--profile", type=int, default=0, help="cProfile the async steps at this batch")
    parser.add_argument(
        "--count-ops",
        action="store_true",
        help="count the aten ops each step dispatches outside the forward, by issuing line (slows the steps)",
    )
    parser.add_argument(
        "--model",
        default="qwen3_14b",
        choices=sorted(MODELS),
        help="the tiny model (qwen35: state slots too)",
    )
    parser.add_argument("--commit", default=None)
    parser.add_argument("--no-write", action="store_true", help="print the figures, append nothing")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the tiny model's matrices: thread hand-offs cost more than the arithmetic
    batches = [int(b) for b in args.batches.split(",") if b]
    sync = [int(b) for b in args.sync.split(",") if b]
    results = Results(args.out, "python " + " ".join(sys.argv), args.commit, device=cpu_name())
    folder = write_tiny_checkpoint(
        tempfile.mkdtemp(prefix="host-overhead-"),
        MODELS[args.model],
        max_position_embeddings=args.ctx + args.steps + 64,
    )
    if args.no_forward and not args.graph_path:
        parser.error("--no-forward replaces the decode graphs' forward: it needs the graph path")
    llm = build(folder, max(batches + sync), args.ctx + args.steps + 64, args.graph_path)
    timer = ForwardTimer(llm.engine.executor.runner.model)
    graphs = llm.engine.executor.runner.graphs
    if graphs is not None:  # the decode graph's whole forward: on a GPU, all of it runs inside the graph
        graphs._forward = timer.timed(graphs._forward)
    rng = random.Random(0)
    table = []
    runs = [(b, True) for b in batches] + [(b, False) for b in sync]
    for batch, on in runs:
        profile = on and batch == args.profile
        d = bench_host(
            llm, timer, batch, args.ctx, args.steps, rng, on, profile, args.no_forward, args.count_ops
        )
        mode = "host_cpu_noforward" if args.no_forward else "host_cpu"
        name = f"{args.model}.{mode}{'' if on else '_sync'}.bs{batch}"
        if "aten_ops" in d:  # the counting slows every op: only the count is a figure of this run
            results.add(f"{name}.aten_ops_per_step", d["aten_ops"], "count")
        else:
            results.add(f"{name}.host_ms", d["host_ms"], "ms", 1.0 if batch == 64 and on else None)
            results.add(f"{name}.step_ms", d["step_ms"], "ms")
            results.add(f"{name}.forward_ms", d["forward_ms"], "ms")
        table.append(
            f"bs{batch:<3} async {'on ' if on else 'off'}  host {d['host_ms']:6.3f} ms/step  "
            f"(step {d['step_ms']:6.3f}, forward {d['forward_ms']:6.3f})"
        )
    if not args.no_write:
        results.write()
    print("\n".join(table))


if __name__ == "__main__":
    main()
