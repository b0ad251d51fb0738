"""Sweep ``fused_moe_triton``'s tiles (block_n x block_k x pipeline depth) at decode batches of 1 and 16
at the Qwen3.5-35B-A3B, DeepSeek-V3 and Moonlight expert shapes, bf16, or DeepSeek-V3's block-FP8
experts (128 x 128 scale tiles) with ``--fp8``; prints the default and the best five with their share of
the streaming-read ceiling. Prints only: its figures are no records.

    python bench/fused_moe_tiles.py [--fp8]

Each of the 16 calls replayed in one graph routes to fresh experts, so no weights come from L2; the bytes
are the distinct experts' gate|up and down.
"""

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import graph_time_ms, stream_read_bytes_per_s  # noqa: E402

from pegainfer.kernels.fused_moe import fused_moe_triton  # noqa: E402
from pegainfer.layers.moe import BlockScales  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--fp8", action="store_true", help="DeepSeek-V3's experts in float8 with 128x128 scales")
args = parser.parse_args()
bw = stream_read_bytes_per_s()
print(f"stream read {bw / 1e12:.2f} TB/s", flush=True)
CASES = {
    "qwen35_35b": (256, 2048, 512, 8),
    "deepseek_v3": (256, 7168, 2048, 8),
    "moonlight": (64, 2048, 1408, 6),
}
if args.fp8:
    CASES = {"deepseek_v3_fp8": CASES["deepseek_v3"]}
TILES = list(
    itertools.product((64, 128), (128, 256), (3, 4))
    if args.fp8
    else itertools.product((16, 32, 64), (64, 128, 256), (3, 4))
)
CALLS = 16
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
    for T in (1, 16):
        x = torch.randn(T, H, device="cuda").bfloat16()
        routes = [torch.stack([torch.randperm(E, device="cuda")[:K] for _ in range(T)]) for _ in range(CALLS)]
        w = torch.rand(T, K, device="cuda")
        used = sum(r.unique().numel() for r in routes) / CALLS * 3 * H * inter * gu.element_size()

        def f(x=x, w=w, routes=routes, gu=gu, dn=dn, scales=scales, **knobs):
            return [fused_moe_triton(x, w, r, gu, dn, scales=scales, **knobs) for r in routes]

        d = graph_time_ms(f, calls=CALLS)
        print(f"{name} T={T}: default tiles {d * 1e3:.1f} us {used / (d / 1e3) / bw:.1%}", flush=True)
        res = []
        for bn, bk, ns in TILES:
            try:
                ms = graph_time_ms(
                    lambda bn=bn, bk=bk, ns=ns: f(block_n=bn, block_k=bk, num_stages=ns), calls=CALLS
                )
            except Exception as e:  # noqa: BLE001
                print("fail", bn, bk, ns, type(e).__name__, flush=True)
                continue
            res.append((ms, bn, bk, ns))
        res.sort()
        for r in res[:5]:
            print(
                f"   {r[0] * 1e3:7.1f} us  bn{r[1]} bk{r[2]} s{r[3]}  {used / (r[0] / 1e3) / bw:.1%}",
                flush=True,
            )
    del gu, dn
    torch.cuda.empty_cache()
