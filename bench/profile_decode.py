"""Where a decode step spends its GPU time: a torch.profiler table of eager decode steps (the same
kernels the CUDA graph replays), grouped by kernel, for random weights in a benchmark shape.

    python bench/profile_decode.py [--model qwen3_14b] [--batch 1] [--layers 40]
    python bench/profile_decode.py --model qwen35 --shape 9b        # or 27b
    python bench/profile_decode.py --model deepseek --shape v3 --layers 4 [--fp8]   # or moonlight

``--cuda-profiler`` brackets one eager step with ``cudaProfilerStart``/``Stop`` (after the warm-up steps,
so no compile or prefill kernel is in it) for hardware counters of that step's kernels:

    ncu --profile-from-start off --clock-control none --section SpeedOfLight \
        python bench/profile_decode.py --model qwen35 --shape 9b --layers 4 --cuda-profiler
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import torch
from common import build, greedy


def checkpoint(model: str, shape: str | None, layers: int | None, fp8: bool) -> tuple[Path, int]:
    """(checkpoint folder, vocabulary size) from the model's own benchmark."""
    if model == "qwen3_14b":
        import qwen3_14b

        return qwen3_14b.checkpoint_folder(layers or 40), qwen3_14b.QWEN3_14B["vocab_size"]
    if model == "qwen35":
        import qwen35

        config = dict(qwen35.SHAPES[shape or "9b"])
        if layers:
            config["num_hidden_layers"] = layers
        return qwen35.checkpoint_folder(config), config["vocab_size"]
    import deepseek

    keys, vocab, _ = deepseek.SHAPES[shape or "v3"]
    return deepseek.checkpoint_folder(
        keys, vocab, layers or deepseek.default_layers(shape or "v3"), fp8
    ), vocab


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3_14b", choices=["qwen3_14b", "qwen35", "deepseek"])
    parser.add_argument("--shape", default=None, help="qwen35: 9b or 27b; deepseek: v3 or moonlight")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--ctx", type=int, default=1024)
    parser.add_argument("--fp8", action="store_true", help="deepseek: a block-FP8 checkpoint")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument(
        "--trace", type=int, default=0, help="also list the first N kernels of one step in launch order"
    )
    parser.add_argument(
        "--cuda-profiler",
        action="store_true",
        help="run one step between cudaProfilerStart and Stop, then exit",
    )
    args = parser.parse_args()
    folder, vocab = checkpoint(args.model, args.shape, args.layers, args.fp8)
    llm = build(folder, max_num_seqs=args.batch, max_model_len=args.ctx + 64, enforce_eager=True)
    engine = llm.engine
    rng = random.Random(0)
    for i in range(args.batch):
        prompt = [rng.randrange(vocab) for _ in range(args.ctx)]
        engine.add_request(str(i), None, greedy(40), prompt_token_ids=prompt)
    for _ in range(4):
        engine.step()
    torch.cuda.synchronize()
    graphs = engine.executor.runner.graphs
    if args.cuda_profiler:
        torch.cuda.cudart().cudaProfilerStart()
        graphs.run(args.batch)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        return
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            graphs.run(args.batch)
        torch.cuda.synchronize()
    events = prof.key_averages()
    rows = sorted(events, key=lambda e: e.device_time_total, reverse=True)
    total = sum(e.device_time_total for e in events) / 5 / 1e3
    print(
        f"{args.model} {args.shape or ''}: GPU time per decode step (eager, batch {args.batch}): {total:.3f} ms "
        f"over {sum(e.count for e in events) // 5} kernels"
    )
    print(f"{'kernel':80s} {'ms/step':>8s} {'calls':>6s} {'share':>6s}")
    for e in rows[: args.top]:
        ms = e.device_time_total / 5 / 1e3
        print(f"{e.key[:80]:80s} {ms:8.3f} {e.count // 5:6d} {ms / total:6.1%}")
    if args.trace:
        print_trace(prof, args.trace)


def print_trace(prof: torch.profiler.profile, count: int) -> None:
    """The last step's first ``count`` kernels in launch order: duration and the idle gap before each
    (eager launches, so gaps are the host's; a graph replays the same kernels back to back)."""
    kernels = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda e: e.time_range.start,
    )
    step = kernels[len(kernels) * 4 // 5 :]  # the fifth of five steps
    print(f"{'#':>4s} {'us':>7s} {'gap':>6s} kernel")
    end = step[0].time_range.start
    for i, e in enumerate(step[:count]):
        gap = e.time_range.start - end
        end = e.time_range.end
        print(f"{i:4d} {e.time_range.elapsed_us():7.1f} {gap:6.1f} {e.name[:100]}")


if __name__ == "__main__":
    main()
