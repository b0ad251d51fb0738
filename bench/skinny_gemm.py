"""Skinny GEMM (decode projections) at Qwen3-14B or Qwen3.5-9B shapes: our Triton kernel against cuBLAS.

    python bench/skinny_gemm.py [--model qwen3_14b|qwen35_9b] [--rows 1,8,16,32,64] [--sweep] [--json PATH] [--out bench/results/skinny_gemm.jsonl]

Each projection is timed as the decode step runs it: inside a CUDA graph, over enough distinct weight
copies (>= 2 GB) that the weights come from HBM, not L2. Achieved bandwidth = weight bytes / time,
against the decode ceiling measured in the same run (the higher of the 1 GiB copy and the streaming-read
rate; before 2026-12-03 these records were against the copy rate). ``--sweep`` tries tile sizes, warps,
pipeline depths and the stream-K split and reports the best of each form beside the default heuristic.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import Results, measure_ceilings, per_call_ms  # noqa: E402

from pegainfer.kernels.skinny_gemm import SkinnyConfig, default_config, skinny_linear_triton  # noqa: E402

# model -> name -> (N, K) of w
SHAPES = {
    # Qwen3-14B: q|k|v, o, gate|up, down, lm_head
    "qwen3_14b": {
        "qkv": (7168, 5120),
        "o_proj": (5120, 5120),
        "gate_up": (34816, 5120),
        "down": (5120, 17408),
        "lm_head": (151936, 5120),
    },
    # Qwen3.5 9B-style (hidden 4096): GDN in_proj (q|k|v|z|b|a) and out_proj, gated attention q|gate|k|v
    # (its o_proj is out_proj's shape), MLP gate|up and down; every 4096-row one makes 64 programs of 64 rows.
    "qwen35_9b": {
        "gdn_in_proj": (12352, 4096),
        "out_proj": (4096, 4096),
        "attn_qkv": (10240, 4096),
        "gate_up": (24576, 4096),
        "down": (4096, 12288),
    },
    # Qwen3.5 27B-like (hidden 5120; GDN 16 k / 48 v heads x 128, attention 24 q / 4 kv heads x 256)
    "qwen35_27b": {
        "gdn_in_proj": (16480, 5120),
        "out_proj": (5120, 6144),
        "attn_qkv": (14336, 5120),
        "gate_up": (34816, 5120),
        "down": (5120, 17408),
    },
    # Qwen3.5 35B-A3B-style (hidden 2048; GDN 16 k / 32 v heads x 128, attention 16 q / 2 kv heads x 256):
    # GDN in_proj and out_proj (o_proj's shape too), attention q|gate|k|v, the router with the shared
    # expert's gate row (the shared expert runs in the expert kernels), lm_head. K = 2048: short rows.
    "qwen35_35b_a3b": {
        "gdn_in_proj": (12352, 2048),
        "out_proj": (2048, 4096),
        "attn_qkv": (9216, 2048),
        "router": (257, 2048),
        "lm_head": (248320, 2048),
    },
    # DeepSeek-V3 (hidden 7168): MLA's q_a, kv_a (latent 512 + rope 64), q_b, o_proj; the dense layer's
    # MLP, the shared expert's; the router's GEMV runs in fp32 elsewhere.
    "deepseek_v3": {
        "q_a": (1536, 7168),
        "kv_a": (576, 7168),
        "q_b": (24576, 1536),
        "o_proj": (7168, 16384),
        "dense_gate_up": (36864, 7168),
        "dense_down": (7168, 18432),
        "shared_gate_up": (4096, 7168),
        "shared_down": (7168, 2048),
    },
}


def sweep_configs(forms: str) -> list[SkinnyConfig]:
    """``forms`` (comma-separated): ``tile``, one program per tile over tile shapes and warps; ``stream_k``,
    the stream-K split (one program per SM, or two) over the deep tiles."""
    per_tile = [
        SkinnyConfig(block_n, block_k, warps, 4)
        for block_n, block_k, warps in itertools.product((32, 64, 128), (64, 128, 256), (4, 8))
        if block_n * block_k <= 64 * 256
    ]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    stream_k = [
        SkinnyConfig(block_n, block_k, 4, stages, stream_k=True, programs=programs)
        for block_n, block_k, stages, programs in itertools.product(
            (32, 64), (128, 256), (3, 4), (sms, 2 * sms)
        )
    ]
    return (per_tile if "tile" in forms.split(",") else []) + (stream_k if "stream_k" in forms else [])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3_14b", choices=sorted(SHAPES))
    ap.add_argument("--rows", default="1,8,16,32,64")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--sweep-forms", default="tile,stream_k")
    ap.add_argument("--json")
    ap.add_argument("--out", default="bench/results/skinny_gemm.jsonl")
    ap.add_argument("--commit", default=None)
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    ceilings = measure_ceilings()
    bw = ceilings["decode_ceiling_bytes_per_s"]
    print(
        f"copy {ceilings['hbm_bytes_per_s'] / 1e12:.2f} TB/s, streaming read "
        f"{ceilings['hbm_read_bytes_per_s'] / 1e12:.2f} TB/s: utilisation against {bw / 1e12:.2f}",
        flush=True,
    )
    results = Results(Path(args.out), "python " + " ".join(sys.argv), args.commit)
    records = []
    for name, (n, k) in SHAPES[args.model].items():
        nbytes = n * k * 2
        copies = max(2, -(-(2 << 30) // nbytes))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x, ws[0])
            cublas = per_call_ms([partial(F.linear, x, w) for w in ws])
            default = default_config(n, k, m, sms=torch.cuda.get_device_properties(0).multi_processor_count)
            err = (skinny_linear_triton(x, ws[0], config=default).float() - ref.float()).abs().max().item()
            ours = per_call_ms([partial(skinny_linear_triton, x, w, config=default) for w in ws])
            row = {
                "shape": name, "m": m, "n": n, "k": k, "cublas_ms": cublas, "ours_ms": ours,
                "default": default.__dict__, "max_abs_err": err,
                "cublas_util": nbytes / (cublas / 1e3) / bw, "ours_util": nbytes / (ours / 1e3) / bw,
            }  # fmt: skip
            if args.sweep:
                timed = []
                for cfg in sweep_configs(args.sweep_forms):
                    try:
                        t = per_call_ms([partial(skinny_linear_triton, x, w, config=cfg) for w in ws], 5)
                    except Exception as exc:  # a tile that does not fit (shared memory) is skipped
                        print(f"  skip {cfg}: {type(exc).__name__}", flush=True)
                        continue
                    timed.append((t, cfg))
                timed.sort(key=lambda tc: tc[0])
                deeper = []
                for _, cfg in timed[:3]:
                    for stages in (3, 5):
                        c = dataclasses.replace(cfg, num_stages=stages)
                        try:
                            t = per_call_ms([partial(skinny_linear_triton, x, w, config=c) for w in ws], 5)
                        except Exception:
                            continue
                        deeper.append((t, c))
                timed = sorted(timed + deeper, key=lambda tc: tc[0])
                row["best"] = [(t, c.__dict__, nbytes / (t / 1e3) / bw) for t, c in timed[:6]]
                row["best_per_tile"], row["best_stream_k"] = (
                    next(
                        ([t, c.__dict__, nbytes / (t / 1e3) / bw] for t, c in timed if c.stream_k == sk), None
                    )
                    for sk in (False, True)
                )
            records.append(row)
            best = "".join(
                f" | {label} {b[0] * 1e3:.1f} us {b[2]:.1%} {b[1]}"
                for label, b in (("tile", row.get("best_per_tile")), ("stream-k", row.get("best_stream_k")))
                if b
            )
            print(
                f"{name:8s} M={m:3d} cuBLAS {cublas * 1e3:7.1f} us ({row['cublas_util']:.1%})  "
                f"ours {ours * 1e3:7.1f} us ({row['ours_util']:.1%}) err {err:.3g}{best}",
                flush=True,
            )
            results.add(
                f"{args.model}.skinny_gemm.{name}_m{m}.ours_bandwidth_utilization",
                row["ours_util"],
                "fraction",
            )
            results.add(
                f"{args.model}.skinny_gemm.{name}_m{m}.cublas_bandwidth_utilization",
                row["cublas_util"],
                "fraction",
            )
        del ws
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps({"ceilings": ceilings, "records": records}, indent=1))
    results.write()


if __name__ == "__main__":
    main()
