"""Sweep the routed experts' tiles at decode batches, at the Qwen3.5-35B-A3B, DeepSeek-V3 and Moonlight expert
shapes in bf16, or DeepSeek-V3's block-FP8 experts (128 x 128 scale tiles) with ``--fp8``; prints the
default and the best five with their share of the streaming-read ceiling. Prints only: its figures are
no records.

    python bench/fused_moe_tiles.py [--fp8]            # the grouped path's tiles (block_n x block_k x stages), batch 1 and 16
    python bench/fused_moe_tiles.py --pairs [--fp8]    # the pair path's split and tiles at 1 token, then
                                                       # against the grouped path at 1..8 tokens
    python bench/fused_moe_tiles.py --pairs --cases qwen35_35b,qwen35_35b_shared   # some shapes only
    python bench/fused_moe_tiles.py --pairs --no-sweep   # the default tiles only (and gate|up in two splits)

Each of the 16 calls replayed in one graph routes to fresh experts, so no weights come from L2; the bytes
are the distinct experts' gate|up and down (the pair path reads an expert once per pair that chose it).
"""

import argparse
import dataclasses
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import graph_time_ms, stream_read_bytes_per_s  # noqa: E402

from pegainfer.kernels import moe_pairs  # noqa: E402
from pegainfer.kernels._triton import num_sms  # noqa: E402
from pegainfer.kernels.fused_moe import fused_moe_triton  # noqa: E402
from pegainfer.layers.moe import BlockScales  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--fp8", action="store_true", help="DeepSeek-V3's experts in float8 with 128x128 scales")
parser.add_argument("--pairs", action="store_true", help="the pair path (moe_pairs) and its tiles")
parser.add_argument("--cases", default="", help="comma-separated expert shapes to run (default: all)")
parser.add_argument(
    "--no-sweep", action="store_true", help="--pairs: the default tiles and the variants only"
)
args = parser.parse_args()
bw = stream_read_bytes_per_s()
print(f"stream read {bw / 1e12:.2f} TB/s", flush=True)
CASES = {
    "qwen35_35b": (256, 2048, 512, 8),
    # The same with the shared expert as a ninth choice (Qwen3.5's SparseMoE; routed here like the others)
    "qwen35_35b_shared": (257, 2048, 512, 9),
    "deepseek_v3": (256, 7168, 2048, 8),
    "moonlight": (64, 2048, 1408, 6),
}
if args.fp8:
    CASES = {"deepseek_v3_fp8": CASES["deepseek_v3"]}
if args.cases:
    CASES = {name: CASES[name] for name in args.cases.split(",")}
TILES = [
    dict(block_n=n, block_k=k, num_stages=s)
    for n, k, s in (
        itertools.product((64, 128), (128, 256), (3, 4))
        if args.fp8
        else itertools.product((16, 32, 64), (64, 128, 256), (3, 4))
    )
]
# The pair path's tiles, swept one launch at a time (the other at its default); float8 keeps the
# columns per load inside a 128-wide scale tile.
PAIR_K = (64, 128) if args.fp8 else (64, 128, 256)
PAIR_GATE_UP = [
    dict(gate_up_n=n, gate_up_k=k, gate_up_stages=s)
    for n, k, s in itertools.product((16, 32, 64), PAIR_K, (3, 4, 5))
]
PAIR_DOWN = [
    dict(down_n=n, down_k=k, down_stages=s) for n, k, s in itertools.product((16, 32, 64), PAIR_K, (3, 4, 5))
]
CALLS = 16


def report(label, ms, used):
    print(f"   {ms * 1e3:7.1f} us  {label}  {used / (ms / 1e3) / bw:.1%}", flush=True)


def best_of(f, variants, used, label):
    res = []
    for knobs in variants:
        try:
            res.append((graph_time_ms(lambda knobs=knobs: f(**knobs), calls=CALLS), knobs))
        except Exception as e:  # noqa: BLE001
            print("fail", knobs, type(e).__name__, flush=True)
    res.sort(key=lambda r: r[0])
    print(f"  best {label}:", flush=True)
    for ms, knobs in res[:5]:
        report(" ".join(f"{k}={v}" for k, v in knobs.items()), ms, used)
    return res[0][1] if res else {}


for name, (E, H, inter, K) in CASES.items():
    dtype = torch.float8_e4m3fn if args.fp8 else torch.bfloat16
    gu = (torch.randn(E, 2 * inter, H, device="cuda") * 0.02).to(dtype)
    dn = (torch.randn(E, H, inter, device="cuda") * 0.02).to(dtype)
    scales = None
    if args.fp8:
        ti, th = inter // 128, H // 128
        scales = BlockScales(
            torch.rand(E, 2, ti, th, device="cuda"), torch.rand(E, th, ti, device="cuda"), (128, 128)
        )
    for T in (1, 2, 4, 8) if args.pairs else (1, 16):
        x = torch.randn(T, H, device="cuda").bfloat16()
        routes = [torch.stack([torch.randperm(E, device="cuda")[:K] for _ in range(T)]) for _ in range(CALLS)]
        w = torch.rand(T, K, device="cuda")
        used = sum(r.unique().numel() for r in routes) / CALLS * 3 * H * inter * gu.element_size()

        def grouped(x=x, w=w, routes=routes, gu=gu, dn=dn, scales=scales, **knobs):
            return [fused_moe_triton(x, w, r, gu, dn, scales=scales, **knobs) for r in routes]

        d = graph_time_ms(grouped, calls=CALLS)
        print(
            f"{name} T={T}: grouped, default tiles {d * 1e3:.1f} us {used / (d / 1e3) / bw:.1%}", flush=True
        )
        if not args.pairs:
            best_of(grouped, TILES, used, "grouped tiles")
            continue
        # Measured past the dispatch's own limits.
        moe_pairs.PAIR_TOKENS = max(moe_pairs.PAIR_TOKENS, T)
        moe_pairs.PAIR_TOKENS_FP8 = max(moe_pairs.PAIR_TOKENS_FP8, T)
        default = moe_pairs.default_tiles(T * K, inter, num_sms(x.device))

        def pairs(x=x, w=w, routes=routes, gu=gu, dn=dn, scales=scales, default=default, **knobs):
            tiles = dataclasses.replace(default, **knobs)
            return [moe_pairs.fused_moe_pairs(x, w, r, gu, dn, scales=scales, tiles=tiles) for r in routes]

        tuned = {}
        if T == 1 and not args.no_sweep:
            # How many programs share gate|up's columns first, then each launch's tiles.
            k = 128 if args.fp8 else 256
            base = dict(gate_up_n=64, gate_up_k=128, gate_up_stages=4, down_n=64, down_k=k, down_stages=3)
            tuned = best_of(pairs, [{**base, "gate_up_split": s} for s in (1, 2, 4)], used, "split")
            tuned = best_of(pairs, [{**tuned, **g} for g in PAIR_GATE_UP], used, "gate_up tiles")
            tuned = best_of(pairs, [{**tuned, **d} for d in PAIR_DOWN], used, "down tiles")
        variants = [("default", {})] + ([("tuned at T=1", tuned)] if tuned else [])
        if T == 1 and default.gate_up_split == 1:  # the split rule's edge: one wave of two programs an SM
            variants.append(("gate|up in two splits", {"gate_up_split": 2}))
        for label, knobs in variants:
            p = graph_time_ms(lambda knobs=knobs: pairs(**knobs), calls=CALLS)
            print(
                f"{name} T={T}: pairs, {label} tiles {p * 1e3:.1f} us {used / (p / 1e3) / bw:.1%}", flush=True
            )
    del gu, dn
    torch.cuda.empty_cache()
