"""Per-step cost of handing a step's plan from rank 0 to a second tensor-parallel rank, on the CPU: the
shared-memory channel (what spawned ranks use) against a torch.distributed broadcast over gloo (what
``torchrun`` ranks use), for the plan of ``--batch`` decoding requests.

    python bench/tp_channel.py                    # 64 requests, both transports, 2000 steps each

Each step rank 0 encodes the batch (``StepEncoder``), sends it, and the other process receives it,
rebuilds the batch (``StepDecoder``) and answers with one byte on a pipe; the figure is the median wall
time of that round trip, so both transports pay the same answer. Two plans are timed: a batch built
anew each step (every chunk's fields travel, the block tables as deltas) and the steady state of async
decoding (a moved-on batch: positions and grown tables only).

Figures go to ``bench/results/tp_channel.jsonl``: ``tp_channel.{shm,dist}.bs{B}.{new,moved_on}_us``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import Results, cpu_name

from pegainfer.executor.model_batch import ModelBatch, SequenceChunk
from pegainfer.executor.step_channel import DistChannel, ShmChannel, ShmReader
from pegainfer.executor.step_message import StepDecoder, StepEncoder
from pegainfer.parallel.distributed import create_store, new_group

BLOCK = 16


def batch_of(size: int, step: int) -> ModelBatch:
    """``size`` decode rows at position 500 + step, carried tokens, 32-page tables (one grows per step)."""
    chunks = []
    for i in range(size):
        table = list(range(i * 64, i * 64 + 32 + (step if i == 0 else 0)))
        chunks.append(SequenceChunk(f"req-{i}", [-1], 500 + step, table, i, False, False, 0, i, 1, False, i))
    return ModelBatch(chunks)


def plans(size: int, steps: int, moved_on: bool) -> list:
    """The messages rank 0 would send over ``steps`` steps."""
    encoder = StepEncoder()
    batch = batch_of(size, 0)
    out = []
    for step in range(steps):
        if moved_on and step:
            for chunk in batch.chunks:
                chunk.start += 1
            batch.chunks[0].block_table.append(10_000 + step)
            batch.moved_on = True
        elif step:
            batch = batch_of(size, step)
        out.append(encoder.batch(batch))
    return out


def reader_main(transport: str, args: list[str]) -> None:
    """The second rank: receive, rebuild, answer one byte; until a ``stop`` message."""
    answer = int(args[-1])
    if transport == "shm":
        name, ready, free = args[0], int(args[1]), int(args[2])
        channel = ShmReader(name, ready, free, 60.0)
    else:
        store = create_store("127.0.0.1", int(args[0]), 2, is_master=False, timeout_s=60)
        channel = DistChannel(new_group(store, 1, 2, "gloo", 60))
    decoder = StepDecoder()
    while True:
        message = channel.recv()
        if message[0] == "stop":
            return
        decoder.batch(message)
        os.write(answer, b"\0")


def time_transport(transport: str, messages: list) -> float:
    """Median round-trip microseconds of ``messages`` over ``transport``."""
    answer_r, answer_w = os.pipe()
    if transport == "shm":
        channel = ShmChannel(1, 60.0)
        ready, free = channel.reader_fds(0)
        args = [channel.name, str(ready), str(free)]
        fds = (ready, free, answer_w)
    else:
        store = create_store("127.0.0.1", 0, 2, is_master=True, timeout_s=60)
        args, fds = [str(store.port)], (answer_w,)
    script = Path(__file__).resolve()
    child = subprocess.Popen(
        [sys.executable, str(script), "--reader", transport, *args, str(answer_w)], pass_fds=fds
    )
    os.close(answer_w)
    if transport == "shm":
        channel.close_reader_ends(0)
    else:
        channel = DistChannel(new_group(store, 0, 2, "gloo", 60))
    times = []
    for message in messages:
        t0 = time.perf_counter()
        channel.send(message)
        os.read(answer_r, 1)
        times.append(time.perf_counter() - t0)
    channel.send(("stop",))
    child.wait(30)
    channel.close()
    os.close(answer_r)
    warm = times[len(times) // 10 :]
    return statistics.median(warm) * 1e6


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--reader":
        reader_main(sys.argv[2], sys.argv[3:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "tp_channel.jsonl")
    parser.add_argument("--commit", default=None)
    args = parser.parse_args()
    device = f"{cpu_name()}, {os.cpu_count()} cores"
    results = Results(args.out, "python " + " ".join(sys.argv), args.commit, device=device)
    table = []
    for kind in ("new", "moved_on"):
        messages = plans(args.batch, args.steps, kind == "moved_on")
        for transport in ("shm", "dist"):
            us = time_transport(transport, messages)
            results.add(f"tp_channel.{transport}.bs{args.batch}.{kind}_us", us, "us")
            table.append((kind, transport, us))
    results.write()
    print(f"\n{'plan':<10}{'transport':<11}{'us per step':>12}")
    for kind, transport, us in table:
        print(f"{kind:<10}{transport:<11}{us:>12.1f}")


if __name__ == "__main__":
    main()
