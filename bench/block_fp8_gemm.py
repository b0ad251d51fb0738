"""Block-FP8 GEMMs at DeepSeek-V3's projection shapes: our W8A16 and W8A8 Triton kernels against the bf16
forms a dequantized checkpoint would run (our skinny kernel at decode rows, cuBLAS).

    python bench/block_fp8_gemm.py [--rows 1,16,64,2048] [--sweep] [--commit C] [--out bench/results/block_fp8_gemm.jsonl]

Decode rows (M <= 64) are timed as the decode step runs them: inside a CUDA graph, over enough distinct
weight copies (>= 2 GB of float8) that the weights come from HBM, not L2; achieved bandwidth = the
float8 weight's and its scales' bytes / time, against the decode ceiling measured in the same run (the
higher of the copy and streaming-read rates). Prefill rows are compute: TFLOP/s beside cuBLAS's bf16.
The W8A8 kernel's figures (``...w8a8...``) include its quantization of x (a pass before the GEMM).
``--sweep`` tries tile shapes, warps and pipeline depths and reports the best beside the default
heuristic (``pegainfer.kernels.block_fp8_gemm.default_config``).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import Results, cuda_time_ms, measure_ceilings, per_call_ms  # noqa: E402

from pegainfer.kernels.block_fp8_gemm import (  # noqa: E402
    DECODE_ROWS,
    Fp8GemmConfig,
    block_fp8_linear_triton,
    default_config,
)
from pegainfer.kernels.block_fp8_w8a8 import block_fp8_w8a8_triton  # noqa: E402
from pegainfer.kernels.skinny_gemm import SkinnyConfig, skinny_linear_triton  # noqa: E402
from pegainfer.layers.activation import interleave_gate_up  # noqa: E402
from pegainfer.layers.block_fp8 import BlockFP8Weight, row_scales  # noqa: E402

# name -> (N, K): MLA's stacked q_a|kv_a, q_b, o_proj; the dense layer's gate|up and down; the shared
# expert's (DeepSeek-V3, tp=1).
SHAPES = {
    "q_a_kv_a": (2112, 7168),
    "q_b": (24576, 1536),
    "o_proj": (7168, 16384),
    "dense_gate_up": (36864, 7168),
    "dense_down": (7168, 18432),
    "shared_gate_up": (4096, 7168),
    "shared_down": (7168, 2048),
}


def random_weight(n: int, k: int, gate_up: bool = False) -> BlockFP8Weight:
    """Random float8 values with a checkpoint's scales: one per 128 x 128 tile, shared by its rows; with
    ``gate_up`` two such halves' rows interleaved, as the engine keeps a gate|up projection (its tiles
    then load two scales, alternating)."""
    w = BlockFP8Weight(n, k, 128).cuda()
    values = (torch.randn(n, k, device="cuda") * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    halves = 2 if gate_up else 1
    tiles = torch.rand(halves, -(-n // halves // 128), w.scale.shape[1], device="cuda") * 1e-3
    scales = [row_scales(t, 128, 0, n // halves) for t in tiles]
    w.load_rows(slice(0, n), values, interleave_gate_up(*scales) if gate_up else scales[0])
    w.settle_scales()
    return w


def sweep_configs(m: int) -> list[Fp8GemmConfig | SkinnyConfig]:
    """This kernel's tiles; at decode rows also the skinny GEMM's float8 form (one program per tile and
    stream-K)."""
    if m <= DECODE_ROWS:
        block_m = max(16, 1 << (m - 1).bit_length())
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        skinny = [
            SkinnyConfig(bn, bk, warps, stages, stream_k=sk, programs=sms if sk else 0)
            for bn, bk, warps, stages, sk in itertools.product(
                (32, 64), (128, 256), (4, 8), (4, 6), (False, True)
            )
        ]
        return skinny + [
            Fp8GemmConfig(block_m, bn, bk, warps, stages)
            for bn, bk, (warps, stages) in itertools.product(
                (16, 32, 64, 128), (128, 256, 512), ((4, 4), (4, 6), (8, 4))
            )
            if bn * bk <= 128 * 256
        ]
    return [
        Fp8GemmConfig(bm, bn, bk, warps, stages)
        for bm, bn, bk, warps, stages in itertools.product(
            (64, 128), (64, 128, 256), (64, 128), (4, 8), (3, 4)
        )
        if bm * bn <= 128 * 128
    ]


def measure_shape(
    name: str, rows: list[int], sweep: list[int], bw: float, sms: int, results: Results
) -> None:
    n, k = SHAPES[name]
    nbytes = n * k + n * -(-k // 128) * 4  # float8 values and per-row scales
    ws = [random_weight(n, k, "gate_up" in name) for _ in range(max(2, -(-(2 << 30) // nbytes)))]
    dense = [w.dequantize(torch.bfloat16) for w in ws[: max(2, -(-(2 << 30) // (2 * n * k)))]]
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = F.linear(x.float(), ws[0].dequantize(torch.float32))
        cfg = default_config(n, m, 128, sms)
        err = ((block_fp8_linear_triton(x, ws[0], config=cfg).float() - ref).norm() / ref.norm()).item()
        tag = f"deepseek_v3.block_fp8_gemm.{name}_m{m}"
        if m <= DECODE_ROWS:
            ours = per_call_ms([partial(block_fp8_linear_triton, x, w) for w in ws])  # the dispatch
            own = per_call_ms([partial(block_fp8_linear_triton, x, w, config=cfg) for w in ws])
            bf16 = per_call_ms([partial(skinny_linear_triton, x, d) for d in dense])
            cublas = per_call_ms([partial(F.linear, x, d) for d in dense])
            w8a8 = per_call_ms([partial(block_fp8_w8a8_triton, x, w) for w in ws])
            util, util8 = nbytes / (ours / 1e3) / bw, nbytes / (w8a8 / 1e3) / bw
            line = f"ours {ours * 1e3:7.1f} us ({util:.1%} of the ceiling on fp8 bytes), own tiles {own * 1e3:.1f}"
            line += f" | w8a8 {w8a8 * 1e3:.1f} us ({util8:.1%})"
            line += f" | bf16: skinny {bf16 * 1e3:.1f} us, cuBLAS {cublas * 1e3:.1f} us"
            results.add(f"{tag}.bandwidth_utilization", util, "fraction")
            results.add(f"{tag}.vs_bf16_skinny", bf16 / ours, "ratio")
            results.add(f"{tag}.w8a8.bandwidth_utilization", util8, "fraction")
            results.add(f"{tag}.w8a8.vs_bf16_skinny", bf16 / w8a8, "ratio")
        else:
            ours = cuda_time_ms(partial(block_fp8_linear_triton, x, ws[0]))  # the dispatch: widened
            own = cuda_time_ms(partial(block_fp8_linear_triton, x, ws[0], config=cfg))
            cublas = cuda_time_ms(partial(F.linear, x, dense[0]))
            w8a8 = cuda_time_ms(partial(block_fp8_w8a8_triton, x, ws[0]))
            tflops, tflops8 = (2 * m * n * k / (t / 1e3) / 1e12 for t in (ours, w8a8))
            line = f"ours {ours * 1e3:7.1f} us ({tflops:.0f} TFLOP/s), own tiles {own * 1e3:.1f}"
            line += f" | w8a8 {w8a8 * 1e3:.1f} us ({tflops8:.0f} TFLOP/s) | cuBLAS bf16 {cublas * 1e3:.1f} us"
            results.add(f"{tag}.tflops", tflops, "TFLOP/s")
            results.add(f"{tag}.vs_cublas_bf16", cublas / ours, "ratio")
            results.add(f"{tag}.w8a8.tflops", tflops8, "TFLOP/s")
            results.add(f"{tag}.w8a8.vs_cublas_bf16", cublas / w8a8, "ratio")
        print(f"{name:14s} M={m:5d} {line} rel err {err:.2e} {cfg}", flush=True)
        if m in sweep:
            timed = []
            for c in sweep_configs(m):
                try:
                    if isinstance(c, SkinnyConfig):
                        t = per_call_ms([partial(skinny_linear_triton, x, w, config=c) for w in ws], 5)
                    elif m <= DECODE_ROWS:
                        t = per_call_ms([partial(block_fp8_linear_triton, x, w, config=c) for w in ws], 5)
                    else:
                        t = cuda_time_ms(partial(block_fp8_linear_triton, x, ws[0], config=c), reps=5)
                except Exception as exc:  # a tile that does not fit (shared memory) is skipped
                    print(f"  skip {c}: {type(exc).__name__}", flush=True)
                    continue
                timed.append((t, c))
            for t, c in sorted(timed, key=lambda tc: tc[0])[:4]:
                print(f"    {t * 1e3:7.1f} us {c}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,16,64,2048")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--sweep-rows", default="", help="rows to sweep (default: every one measured)")
    ap.add_argument("--out", default="bench/results/block_fp8_gemm.jsonl")
    ap.add_argument("--commit", default=None)
    args = ap.parse_args()
    ceilings = measure_ceilings()
    bw = ceilings["decode_ceiling_bytes_per_s"]
    print(f"decode ceiling {bw / 1e12:.2f} TB/s (copy {ceilings['hbm_bytes_per_s'] / 1e12:.2f})", flush=True)
    results = Results(Path(args.out), "python " + " ".join(sys.argv), args.commit)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name in args.shapes.split(","):
        sweep = [int(r) for r in (args.sweep_rows or args.rows).split(",")] if args.sweep else []
        measure_shape(name, [int(r) for r in args.rows.split(",")], sweep, bw, sms, results)
        torch.cuda.empty_cache()
    results.write()


if __name__ == "__main__":
    main()
