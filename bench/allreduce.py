"""Latency of one tensor-parallel all-reduce of a decode step's activations: ``rows`` x ``hidden`` bf16
(Qwen3-14B's 5120 by default) summed over ``--tp`` GPUs through the engine's own collective
(``pegainfer.parallel.distributed.TensorParallel.all_reduce`` on an NCCL group made as the engine makes
it), eager and captured in a CUDA graph (as the decode graphs run them: two a layer).

    python bench/allreduce.py --tp 2 [--rows 1,64] [--hidden 5120] [--commit C] [--out bench/results/allreduce.jsonl]

One process per GPU, started here; NVLink multicast off in each (``set_collective_env``). The graph holds
``--per-graph`` all-reduces back to back, so a replay's time over their count is one all-reduce's
latency without the launch; eager is the mean over as many calls. The published anchor: ~6 us on 2 x
H100 with NCCL in a graph. Figures ``tpN.all_reduce.bf16_H.bsR.{graph,eager}_us``.

Without a GPU (``--device cpu``) the same harness runs over gloo, eager only: a check of the script,
not a figure (nothing is written).
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from pegainfer.parallel.distributed import TensorParallel, create_store, new_group, set_collective_env


def timed_us(fn, calls: int, device: torch.device) -> float:
    """Mean microseconds a call of ``fn`` over ``calls`` calls (after a warm-up)."""
    fn()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1e3 / calls
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) * 1e6 / calls


def rank_main(rank: int, args: argparse.Namespace, port: int, queue) -> None:
    set_collective_env()
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = create_store("127.0.0.1", port, args.tp, is_master=rank == 0, timeout_s=120)
    backend = "nccl" if device.type == "cuda" else "gloo"
    group = new_group(store, rank, args.tp, backend, 120, device if device.type == "cuda" else None)
    tp = TensorParallel(rank=rank, size=args.tp, group=group, local_rank=rank)
    out = {}
    for rows in [int(r) for r in args.rows.split(",")]:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        x = torch.ones(rows, args.hidden, dtype=dtype, device=device)
        tp.all_reduce(x)
        if not bool((x == args.tp).all()):  # a sum over the ranks, not a copy
            raise RuntimeError(f"rank {rank}: the all-reduce of ones gave {x.flatten()[:4].tolist()}")
        eager = timed_us(lambda x=x: tp.all_reduce(x), args.per_graph, device)
        graph_us = float("nan")
        if device.type == "cuda":
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # NCCL's first calls on a stream before its capture
                for _ in range(3):
                    tp.all_reduce(x)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(args.per_graph):
                    tp.all_reduce(x)
            graph_us = timed_us(graph.replay, 20, device) / args.per_graph
        out[rows] = (eager, graph_us)
    if rank == 0:
        queue.put(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--rows", default="1,64")
    parser.add_argument("--hidden", type=int, default=5120)
    parser.add_argument("--per-graph", type=int, default=200)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "allreduce.jsonl")
    parser.add_argument("--commit", default=None)
    args = parser.parse_args()
    if args.device == "cuda" and torch.cuda.device_count() < args.tp:
        sys.exit(f"--tp {args.tp} needs {args.tp} GPUs, this host has {torch.cuda.device_count()}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, args, port, queue)) for r in range(args.tp)]
    for p in procs:
        p.start()
    try:
        out = queue.get(timeout=600)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    if any(p.exitcode for p in procs):
        sys.exit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
    for rows, (eager, graph_us) in out.items():
        print(
            f"tp={args.tp} all-reduce {rows} x {args.hidden}: eager {eager:.1f} us, in a graph {graph_us:.1f} us"
        )
    if args.device != "cuda":
        return
    sys.path.insert(0, str(Path(__file__).parent))
    from common import Results

    gpus = f"{args.tp}x {torch.cuda.get_device_name()}"
    results = Results(args.out, "python " + " ".join(sys.argv), args.commit, device=gpus)
    for rows, (eager, graph_us) in out.items():
        name = f"tp{args.tp}.all_reduce.bf16_{args.hidden}.bs{rows}"
        results.add(f"{name}.eager_us", eager, "us")
        results.add(f"{name}.graph_us", graph_us, "us")
    results.write()


if __name__ == "__main__":
    main()
