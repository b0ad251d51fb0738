"""The Gated DeltaNet decode kernel's tiles on the GPU: value columns per program (``block_v``; below a
whole head the gated norm is a second launch) and warps, at the Qwen3.5 shapes' heads (16 key heads, 32
or 48 value heads of 128 x 128), batch 1, 16 and 64. Prints only, no records: the defaults it informs
cite its output in their docstrings.

    python bench/gdn_decode_tiles.py [--rows 1,16,64] [--value-heads 32,48]

Each call is timed as the decode graph runs it: many calls in one CUDA graph, each on state slots of its
own, so the states (read and written once a call: rows x heads x 64 KB each way) come from HBM, not L2.
The rate printed is that state traffic over the time; warps 0 is the kernel's default.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import graph_time_ms  # noqa: E402

from pegainfer_qwen35 import gdn_kernels  # noqa: E402

KEY_HEADS, DK, DV = 16, 128, 128


def time_case(rows: int, hv: int, block_v: int | None, warps: int | None) -> tuple[float, float]:
    """(µs per call, state traffic in TB/s)."""
    state_bytes = rows * hv * DK * DV * 4
    calls = max(2, -(-(1 << 30) // state_bytes))  # >= 1 GiB of states a replay
    dev, dt = "cuda", torch.bfloat16
    qkv = torch.randn(rows, 2 * KEY_HEADS * DK + hv * DV, device=dev, dtype=dt)
    ba = torch.randn(rows, 2 * hv, device=dev, dtype=dt)
    z = torch.randn(rows, hv * DV, device=dev, dtype=dt)
    a_log, dt_bias = torch.randn(hv, device=dev), torch.randn(hv, device=dev)
    norm = torch.ones(DV, device=dev, dtype=dt)
    state = torch.randn(calls * rows, hv, DK, DV, device=dev) * 0.01
    slots = torch.arange(calls * rows, device=dev, dtype=torch.int32).view(calls, rows)
    out = torch.empty(rows, hv * DV, device=dev, dtype=dt)

    def run():
        for i in range(calls):
            gdn_kernels.gdn_decode(
                qkv, ba[:, :hv], ba[:, hv:], z, a_log, dt_bias, norm, state, slots[i], out,
                num_key_heads=KEY_HEADS, eps=1e-6, block_v=block_v, num_warps=warps,
            )  # fmt: skip

    ms = graph_time_ms(run, calls=calls, reps=10)
    return ms * 1e3, 2 * state_bytes / (ms * 1e-3) / 1e12


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--value-heads", default="32,48")
    args = ap.parse_args()
    print(f"{'rows':>4} {'Hv':>3} {'block_v':>7} {'warps':>5} {'us':>8} {'TB/s':>6}", flush=True)
    for rows, hv in itertools.product(
        (int(r) for r in args.rows.split(",")), (int(h) for h in args.value_heads.split(","))
    ):
        results = []
        for block_v, warps in itertools.product((None, 64, 32, 16), (None, 1, 2, 4, 8)):
            us, rate = time_case(rows, hv, block_v, warps)
            results.append((us, block_v, warps))
            print(f"{rows:4d} {hv:3d} {block_v or DV:7d} {warps or 0:5d} {us:8.2f} {rate:6.2f}", flush=True)
        us, block_v, warps = min(results, key=lambda r: r[0])
        print(f"best at rows {rows}, Hv {hv}: block_v {block_v or DV}, warps {warps or 0}: {us:.2f} us")


if __name__ == "__main__":
    main()
