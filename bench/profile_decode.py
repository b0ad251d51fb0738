"""Where a Qwen3-14B decode step spends its GPU time: a torch.profiler table of one eager decode step
(the same kernels the CUDA graph replays), grouped by kernel, against the weight-read floor.

    python bench/profile_decode.py [--batch 1] [--layers 40]
"""

from __future__ import annotations

import argparse
import random

import torch
from common import build, greedy
from qwen3_14b import checkpoint_folder, random_prompt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--layers", type=int, default=40)
    parser.add_argument("--ctx", type=int, default=1024)
    args = parser.parse_args()
    llm = build(
        checkpoint_folder(args.layers),
        max_num_seqs=args.batch,
        max_model_len=args.ctx + 64,
        enforce_eager=True,
    )
    engine = llm.engine
    rng = random.Random(0)
    for i in range(args.batch):
        engine.add_request(str(i), None, greedy(40), prompt_token_ids=random_prompt(rng, args.ctx))
    for _ in range(4):
        engine.step()
    torch.cuda.synchronize()
    graphs = engine.executor.runner.graphs
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            graphs.run(args.batch)
        torch.cuda.synchronize()
    events = prof.key_averages()
    rows = sorted(events, key=lambda e: e.device_time_total, reverse=True)
    total = sum(e.device_time_total for e in events) / 5 / 1e3
    print(
        f"GPU time per decode step (eager, batch {args.batch}): {total:.3f} ms over "
        f"{sum(e.count for e in events) // 5} kernels"
    )
    print(f"{'kernel':80s} {'ms/step':>8s} {'calls':>6s} {'share':>6s}")
    for e in rows[:25]:
        ms = e.device_time_total / 5 / 1e3
        print(f"{e.key[:80]:80s} {ms:8.3f} {e.count // 5:6d} {ms / total:6.1%}")


if __name__ == "__main__":
    main()
