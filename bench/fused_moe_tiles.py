"""Sweep ``fused_moe_triton``'s tiles (block_n x block_k x pipeline depth) at decode batches of 1 and 16,
bf16, at the Qwen3.5-35B-A3B, DeepSeek-V3 and Moonlight expert shapes; prints the default and the best
five with their share of the streaming-read ceiling. Prints only: its figures are no records.

    python bench/fused_moe_tiles.py

Each of the 16 calls replayed in one graph routes to fresh experts, so no weights come from L2; the bytes
are the distinct experts' gate|up and down.
"""

import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import graph_time_ms, stream_read_bytes_per_s  # noqa: E402

from pegainfer.kernels.fused_moe import fused_moe_triton  # noqa: E402

bw = stream_read_bytes_per_s()
print(f"stream read {bw / 1e12:.2f} TB/s", flush=True)
CASES = {
    "qwen35_35b": (256, 2048, 512, 8),
    "deepseek_v3": (256, 7168, 2048, 8),
    "moonlight": (64, 2048, 1408, 6),
}
CALLS = 16
for name, (E, H, inter, K) in CASES.items():
    gu = (torch.randn(E, 2 * inter, H, device="cuda") * 0.02).bfloat16()
    dn = (torch.randn(E, H, inter, device="cuda") * 0.02).bfloat16()
    for T in (1, 16):
        x = torch.randn(T, H, device="cuda").bfloat16()
        routes = [torch.stack([torch.randperm(E, device="cuda")[:K] for _ in range(T)]) for _ in range(CALLS)]
        w = torch.rand(T, K, device="cuda")
        used = sum(r.unique().numel() for r in routes) / CALLS * 3 * H * inter * 2
        res = []
        for bn, bk, ns in itertools.product((16, 32, 64), (64, 128, 256), (3, 4)):

            def f(bn=bn, bk=bk, ns=ns, x=x, w=w, routes=routes, gu=gu, dn=dn):
                return [
                    fused_moe_triton(x, w, r, gu, dn, block_n=bn, block_k=bk, num_stages=ns) for r in routes
                ]

            try:
                ms = graph_time_ms(f, calls=CALLS)
            except Exception as e:  # noqa: BLE001
                print("fail", bn, bk, ns, type(e).__name__, flush=True)
                continue
            res.append((ms, bn, bk, ns))
        res.sort()
        d = [r for r in res if r[1:] == (64, 64, 3)][0]  # the tiles before 28fcf44
        print(f"{name} T={T}: 64x64x3 {d[0] * 1e3:.1f} us {used / (d[0] / 1e3) / bw:.1%}", flush=True)
        for r in res[:5]:
            print(
                f"   {r[0] * 1e3:7.1f} us  bn{r[1]} bk{r[2]} s{r[3]}  {used / (r[0] / 1e3) / bw:.1%}",
                flush=True,
            )
    del gu, dn
    torch.cuda.empty_cache()
