"""Kernel micro-benchmarks at Qwen3-14B shapes (40 q heads, 8 KV heads, head_dim 128, pages of 16, bf16)
against the ceilings measured in the same run, the torch references and torch SDPA.

    python bench/kernels.py [--json PATH] [--out bench/results/kernels.jsonl] [--sweep]
    python bench/kernels.py --smoke      # tiny shapes on the CPU through the Triton interpreter

- Decode attention, batch 1/8/32/64/128 at 1024 tokens of context: timed as in the decode step, in a
  CUDA graph, over enough distinct caches that the K/V read comes from HBM, not L2; achieved bandwidth
  = bytes of K/V (+ q and out) / time, against the 1 GiB copy bandwidth. A few split counts and tile
  sizes are tried (``--sweep``: many more) and the best is reported beside the default heuristic.
- Prefill attention, 8 x 1024 and 1 x 8192 fresh prompts and a 2048-token chunk behind a 6144-token
  prefix: TFLOP/s (causal FLOPs) against the measured bf16 matmul rate; torch SDPA (flash, on
  contiguous K/V) beside it.
- Fused ops at 1, 64 and 8192 tokens: time and bandwidth against the torch reference sequence.
The table comes last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are decorated

import torch
import torch.nn.functional as F
from common import graph_time_ms

from pegainfer.kernels import activations, norms, rope_kv
from pegainfer.kernels.paged_decode_attention import (
    decode_num_splits,
    paged_decode_attention_ref,
    paged_decode_attention_triton,
)
from pegainfer.kernels.paged_prefill_attention import (
    default_prefill_config,
    key_splits,
    paged_prefill_attention_ref,
    paged_prefill_attention_triton,
    prefill_tensors,
)
from pegainfer.layers.attention import PrefillSegment
from pegainfer.layers.rotary import RotaryEmbedding

BF16 = torch.bfloat16


class Bench:
    def __init__(self, smoke: bool) -> None:
        self.smoke = smoke
        self.device = "cpu" if smoke else "cuda"
        self.figures: list[dict] = []
        self.table: list[tuple[str, ...]] = []
        self.best: dict[str, dict] = {}

    # ---------------------------------------------------------------------------------------- timing

    def graph_ms(self, fn: Callable[[], object], calls: int = 1, reps: int = 30) -> float:
        """Median ms per call of ``fn`` (which makes ``calls`` calls) replayed as one CUDA graph."""
        if self.smoke:
            return self.wall_ms(fn) / calls
        return graph_time_ms(fn, calls, reps)

    def eager_ms(self, fn: Callable[[], object], rep_ms: int = 100) -> float:
        """Median ms of ``fn`` launched eagerly, L2 flushed before each repetition (do_bench)."""
        if self.smoke:
            return self.wall_ms(fn)
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")

    @staticmethod
    def wall_ms(fn: Callable[[], object]) -> float:
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    def try_ms(self, timer: Callable[..., float], fn: Callable[[], object], *args) -> float | None:
        try:
            return timer(fn, *args)
        except Exception as exc:  # a config that does not compile or fit: report, keep going
            print(f"  skipped: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}", flush=True)
            if not self.smoke:
                torch.cuda.synchronize()
            return None

    def add(self, figure: str, value: float, unit: str) -> None:
        self.figures.append({"figure": f"kernels.{figure}", "value": round(float(value), 6), "unit": unit})

    # -------------------------------------------------------------------------------------- ceilings

    def _copy_ms(self) -> float:
        x = torch.randn((1 << 30) // 2, device="cuda", dtype=BF16)
        y = torch.empty_like(x)
        return self.eager_ms(lambda: y.copy_(x), rep_ms=200)

    def _matmul_ms(self) -> float:
        a = torch.randn(8192, 8192, device="cuda", dtype=BF16)
        b = torch.randn(8192, 8192, device="cuda", dtype=BF16)
        return self.eager_ms(lambda: a @ b, rep_ms=300)

    def ceilings(self) -> dict[str, float]:
        if self.smoke:
            return {"hbm_bytes_per_s": 1e10, "bf16_flops_per_s": 1e11}
        copy_ms, mm_ms = self._copy_ms(), self._matmul_ms()
        out = {
            "hbm_bytes_per_s": 2 * (1 << 30) / (copy_ms / 1e3),
            "bf16_flops_per_s": 2 * 8192**3 / (mm_ms / 1e3),
        }
        self.add("ceiling.copy_bandwidth", out["hbm_bytes_per_s"] / 1e9, "GB/s")
        self.add("ceiling.bf16_matmul", out["bf16_flops_per_s"] / 1e12, "TFLOP/s")
        self.table.append(
            ("ceiling", "HBM copy (1 GiB, r+w)", f"{out['hbm_bytes_per_s'] / 1e12:.2f} TB/s", "", "")
        )
        self.table.append(
            ("ceiling", "bf16 matmul 8192^3", f"{out['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s", "", "")
        )
        return out


# ------------------------------------------------------------------------------------ decode attention


def bench_decode(
    b: Bench, shape: dict, batches: list[int], ctx: int, max_model_len: int, sweep: bool, bw: float
) -> None:
    for batch in batches:
        _decode_batch(b, shape, batch, ctx, max_model_len, sweep, bw)


def _decode_batch(
    b: Bench, shape: dict, batch: int, ctx: int, max_model_len: int, sweep: bool, bw: float
) -> None:
    heads, kv_heads, d, page = shape["heads"], shape["kv_heads"], shape["head_dim"], shape["page"]
    scale = d**-0.5
    l2 = 60 << 20 if b.smoke else getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 60 << 20)
    width = max_model_len // page
    kv_bytes = batch * ctx * kv_heads * d * 2 * 2
    io_bytes = kv_bytes + 2 * batch * heads * d * 2
    copies = 1 if b.smoke else max(1, math.ceil(4 * l2 / kv_bytes))
    pages = ctx // page
    cache = torch.randn(2, copies * batch * pages + 1, page, kv_heads, d, device=b.device, dtype=BF16)
    perm = torch.randperm(copies * batch * pages, device=b.device).int() + 1  # page 0: the padding page
    tables = torch.zeros(copies, batch, width, dtype=torch.int32, device=b.device)
    tables[:, :, :pages] = perm.view(copies, batch, pages)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=b.device)
    qs = torch.randn(copies, batch, heads, d, device=b.device, dtype=BF16)
    out = torch.empty(batch, heads, d, device=b.device, dtype=BF16)

    def run(**kw):
        def fn():
            for c in range(copies):
                paged_decode_attention_triton(
                    qs[c], cache, tables[c], seq_lens, scale, out=out, max_seq_len=max_model_len, **kw
                )

        return fn

    auto_splits = decode_num_splits(batch, kv_heads, max_model_len, torch.device(b.device))
    configs = [{}]
    if sweep:
        for splits in (1, 2, 4, 8, 16, 32, 64):
            for bn in (16, 32, 64, 128):
                for warps in (2, 4, 8):
                    for stages in (2, 3):
                        configs.append(
                            {"num_splits": splits, "block_n": bn, "num_warps": warps, "num_stages": stages}
                        )
    else:
        configs += [{"num_splits": s} for s in (1, 2, 4, 8, 16, 32) if s != auto_splits]
        configs += [{"block_n": bn} for bn in (32, 128)] + [{"num_stages": 3}, {"num_warps": 8}]
    timed = []
    for cfg in configs:
        ms = b.try_ms(b.graph_ms, run(**cfg), copies)
        if ms is not None:
            timed.append((ms, cfg))
    default_ms = timed[0][0] if timed and timed[0][1] == {} else float("nan")
    best_ms, best_cfg = min(timed, key=lambda t: t[0]) if timed else (float("nan"), {})
    b.best[f"decode.bs{batch}"] = {"ms": best_ms, **best_cfg}

    ref_ms = b.try_ms(
        b.eager_ms, lambda: paged_decode_attention_ref(qs[0], cache, tables[0][:, :pages], seq_lens, scale)
    )
    k = torch.randn(batch, kv_heads, ctx, d, device=b.device, dtype=BF16)
    v = torch.randn_like(k)
    q4 = qs[0].unsqueeze(2)
    sdpa_ms = b.try_ms(
        b.eager_ms, lambda: F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)
    )

    tag = f"decode_attention.bs{batch}.ctx{ctx}"
    b.add(f"{tag}.us", default_ms * 1e3, "us")
    b.add(f"{tag}.bandwidth_utilization", io_bytes / (default_ms / 1e3) / bw, "fraction")
    b.add(f"{tag}.best_us", best_ms * 1e3, "us")
    b.add(f"{tag}.best_bandwidth_utilization", io_bytes / (best_ms / 1e3) / bw, "fraction")
    if ref_ms:
        b.add(f"{tag}.torch_reference_us", ref_ms * 1e3, "us")
    if sdpa_ms:
        b.add(f"{tag}.torch_sdpa_contiguous_us", sdpa_ms * 1e3, "us")
    b.table.append(
        (
            "decode attn",
            f"bs {batch:>3} ctx {ctx} (splits {auto_splits})",
            f"{default_ms * 1e3:7.1f} us {io_bytes / (default_ms / 1e3) / bw:5.0%} BW",
            f"best {best_ms * 1e3:6.1f} us {io_bytes / (best_ms / 1e3) / bw:4.0%} {best_cfg}",
            f"ref {_us(ref_ms)} sdpa {_us(sdpa_ms)}",
        )
    )


def _us(ms: float | None) -> str:
    return "n/a" if ms is None else f"{ms * 1e3:.1f} us"


# ----------------------------------------------------------------------------------- prefill attention


def bench_prefill(
    b: Bench, shape: dict, cases: list[tuple[str, int, int, int]], sweep: bool, flops_rate: float
) -> None:
    for case in cases:
        _prefill_case(b, shape, *case, sweep=sweep, flops_rate=flops_rate)


def _prefill_case(
    b: Bench, shape: dict, name: str, count: int, q_len: int, ctx: int, *, sweep: bool, flops_rate: float
) -> None:
    heads, kv_heads, d, page = shape["heads"], shape["kv_heads"], shape["head_dim"], shape["page"]
    scale = d**-0.5
    pages = -(-ctx // page)
    cache = torch.randn(2, count * pages + 1, page, kv_heads, d, device=b.device, dtype=BF16)
    perm = torch.randperm(count * pages) + 1
    segs = [PrefillSegment(i * q_len, q_len, ctx, perm[i * pages : (i + 1) * pages]) for i in range(count)]
    meta = prefill_tensors(segs, b.device)
    q = torch.randn(count * q_len, heads, d, device=b.device, dtype=BF16)
    out = torch.empty_like(q)
    attended = count * (q_len * (ctx - q_len) + q_len * (q_len + 1) // 2)
    flops = 4 * heads * d * attended

    configs = [None]
    candidates = [
        (128, 64, 8, 3),
        (128, 128, 8, 3),
        (64, 64, 4, 3),
        (128, 64, 4, 3),
        (128, 32, 8, 4),
        (64, 128, 4, 2),
    ]
    if sweep:
        candidates += [
            (bm, bn, w, s) for bm in (64, 128) for bn in (32, 64, 128) for w in (4, 8) for s in (2, 3, 4)
        ]
    configs += candidates if (sweep or not b.smoke) else candidates[:1]
    timed = []
    for cfg in configs:
        kw = (
            {}
            if cfg is None
            else dict(zip(("block_m", "block_n", "num_warps", "num_stages"), cfg, strict=True))
        )
        ms = b.try_ms(b.eager_ms, _prefill_call(q, cache, meta, scale, out, kw))
        if ms is not None:
            timed.append((ms, cfg))
    default_ms = timed[0][0] if timed and timed[0][1] is None else float("nan")
    best_ms, best_cfg = min(timed, key=lambda t: t[0]) if timed else (float("nan"), None)
    best_cfg = best_cfg or default_prefill_config(d, BF16)
    b.best[f"prefill.{name}"] = {
        "ms": best_ms,
        "block_m": best_cfg[0],
        "block_n": best_cfg[1],
        "num_warps": best_cfg[2],
        "num_stages": best_cfg[3],
    }

    ref_ms = None
    if count * q_len * ctx <= 8192 * 8192:
        ref_ms = b.try_ms(b.eager_ms, lambda: paged_prefill_attention_ref(q, cache, meta, scale))
    sdpa_ms = None
    if q_len == ctx:  # SDPA's causal mask is aligned top-left: only fresh prompts compare
        qb = q.view(count, q_len, heads, d).transpose(1, 2)
        kb = torch.randn(count, kv_heads, ctx, d, device=b.device, dtype=BF16)
        vb = torch.randn_like(kb)
        sdpa_ms = b.try_ms(
            b.eager_ms,
            lambda: F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale, enable_gqa=True),
        )
        ke = kb.repeat_interleave(heads // kv_heads, dim=1)
        ve = vb.repeat_interleave(heads // kv_heads, dim=1)
        expanded_ms = b.try_ms(
            b.eager_ms, lambda: F.scaled_dot_product_attention(qb, ke, ve, is_causal=True, scale=scale)
        )
        if expanded_ms is not None and (sdpa_ms is None or expanded_ms < sdpa_ms):
            sdpa_ms = expanded_ms

    # Side by side: the keys split over programs (key_splits, a short chunk over a long context) or not.
    unsplit_ms = None
    if key_splits(heads, -(-q_len // default_prefill_config(d, BF16)[0]), ctx, q.device) > 1:
        unsplit_ms = b.try_ms(b.eager_ms, _prefill_call(q, cache, meta, scale, out, {"num_splits": 1}))

    tag = f"prefill_attention.{name}"
    rate = flops / (default_ms / 1e3)
    b.add(f"{tag}.ms", default_ms, "ms")
    b.add(f"{tag}.tflops", rate / 1e12, "TFLOP/s")
    b.add(f"{tag}.fraction_of_matmul_rate", rate / flops_rate, "fraction")
    b.add(f"{tag}.best_ms", best_ms, "ms")
    if sdpa_ms:
        b.add(f"{tag}.torch_sdpa_ms", sdpa_ms, "ms")
    if ref_ms:
        b.add(f"{tag}.torch_reference_ms", ref_ms, "ms")
    if unsplit_ms:
        b.add(f"{tag}.keys_unsplit_ms", unsplit_ms, "ms")
    b.table.append(
        (
            "prefill attn",
            name,
            f"{default_ms:7.3f} ms {rate / 1e12:5.0f} TFLOP/s ({rate / flops_rate:.0%} mm)",
            f"best {best_ms:.3f} ms {best_cfg}",
            f"sdpa {_ms(sdpa_ms)} ref {_ms(ref_ms)} unsplit {_ms(unsplit_ms)}",
        )
    )


def _prefill_call(q, cache, meta, scale, out, kw) -> Callable[[], object]:
    return lambda: paged_prefill_attention_triton(q, cache, meta, scale, out=out, **kw)


def _ms(ms: float | None) -> str:
    return "n/a" if ms is None else f"{ms:.3f} ms"


# ------------------------------------------------------------------------------------------ fused ops


def bench_fused(b: Bench, shape: dict, tokens: list[int], bw: float) -> None:
    rotary = RotaryEmbedding(shape["head_dim"], 1e6, 40960).to(b.device)
    for t in tokens:
        _fused_tokens(b, shape, t, rotary, bw)


def _fused_tokens(b: Bench, shape: dict, t: int, rotary: RotaryEmbedding, bw: float) -> None:
    hidden, inter, d = shape["hidden"], shape["inter"], shape["head_dim"]
    heads, kv_heads, page, eps = shape["heads"], shape["kv_heads"], shape["page"], 1e-6
    dev = b.device
    x, res = torch.randn(t, hidden, device=dev, dtype=BF16), torch.randn(t, hidden, device=dev, dtype=BF16)
    w = torch.randn(hidden, device=dev, dtype=BF16)
    gate_up = torch.randn(t, 2 * inter, device=dev, dtype=BF16)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, device=dev, dtype=BF16)
    q, k, v = (p.view(t, -1, d) for p in qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1))
    qw, kw = torch.randn(d, device=dev, dtype=BF16), torch.randn(d, device=dev, dtype=BF16)
    pos = torch.randint(0, 40960, (t,), device=dev)
    blocks = max(2, -(-t // page) * 2)
    cache = torch.randn(2, blocks, page, kv_heads, d, device=dev, dtype=BF16)
    slots = torch.randperm(blocks * page, device=dev)[:t]
    e = 2  # bytes per element

    def qk_ref():  # the reference sequence without its negative-slot filter (a host sync)
        q2, k2 = rotary(pos, norms.rms_norm_ref(q, qw, eps), norms.rms_norm_ref(k, kw, eps))
        rope_kv.write_kv_ref(cache, k2, v, slots)

    cases = [
        (
            "rms_norm",
            2 * t * hidden * e,
            lambda: norms.rms_norm_triton(x, w, eps),
            lambda: norms.rms_norm_ref(x, w, eps),
        ),
        (
            "add_rms_norm",
            4 * t * hidden * e,
            lambda: norms.fused_add_rms_norm_triton(x, res, w, eps),
            lambda: norms.fused_add_rms_norm_ref(x, res, w, eps),
        ),
        (
            "silu_mul",
            3 * t * inter * e,
            lambda: activations.silu_mul_triton(gate_up),
            lambda: activations.silu_mul_ref(gate_up),
        ),
        (
            "qk_norm_rope_kv_write",
            t * d * e * (2 * (heads + kv_heads) + 3 * kv_heads),
            lambda: rope_kv.qk_norm_rope_triton(
                q, k, qw, kw, rotary, pos, eps, kv_cache=cache, v=v, slot_mapping=slots
            ),
            qk_ref,
        ),
        (
            "write_kv",
            4 * t * kv_heads * d * e,
            lambda: rope_kv.write_kv_triton(cache, k, v, slots),
            lambda: rope_kv.write_kv_ref(cache, k, v, slots),
        ),
    ]
    for name, nbytes, kern, ref in cases:
        ms = b.try_ms(b.graph_ms, kern)
        ref_ms = b.try_ms(b.graph_ms, ref)
        if ms is None:
            continue
        tag = f"fused.{name}.t{t}"
        b.add(f"{tag}.us", ms * 1e3, "us")
        b.add(f"{tag}.bandwidth_utilization", nbytes / (ms / 1e3) / bw, "fraction")
        if ref_ms:
            b.add(f"{tag}.torch_reference_us", ref_ms * 1e3, "us")
        b.table.append(
            (
                "fused",
                f"{name} T={t}",
                f"{ms * 1e3:7.1f} us {nbytes / (ms / 1e3) / bw:5.0%} BW",
                f"torch ref {_us(ref_ms)}",
                f"x{ref_ms / ms:.1f}" if ref_ms else "",
            )
        )


# ----------------------------------------------------------------------------------------------- main


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--json", type=Path, default=None, help="write every figure and the best configs here"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).parent / "results" / "kernels.jsonl",
        help="JSONL history to append to",
    )
    parser.add_argument("--no-out", action="store_true", help="do not append to the JSONL history")
    parser.add_argument("--sweep", action="store_true", help="try many more tile/split/warp/stage configs")
    parser.add_argument("--batches", default="1,8,32,64,128")
    parser.add_argument("--ctx", type=int, default=1024)
    parser.add_argument(
        "--max-model-len", type=int, default=8192, help="block-table width and split heuristic bound"
    )
    parser.add_argument("--skip", default="", help="comma list of sections to skip: decode,prefill,fused")
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shapes on the CPU (interpreter), checks the script"
    )
    parser.add_argument("--commit", default=None, help="the commit measured (default: git's HEAD)")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))

    b = Bench(args.smoke)
    if args.smoke:
        shape = {"heads": 4, "kv_heads": 2, "head_dim": 64, "page": 16, "hidden": 256, "inter": 512}
        batches, ctx, max_len = [1, 2], 48, 128
        prefill_cases = [("2x32", 2, 32, 32), ("chunk16@32", 1, 16, 48)]
        fused_tokens = [1, 8]
    else:
        if not torch.cuda.is_available():
            sys.exit("bench/kernels.py needs a CUDA GPU (or --smoke for a CPU check of the script)")
        shape = {"heads": 40, "kv_heads": 8, "head_dim": 128, "page": 16, "hidden": 5120, "inter": 17408}
        batches, ctx, max_len = [int(x) for x in args.batches.split(",")], args.ctx, args.max_model_len
        prefill_cases = [
            ("8x1024", 8, 1024, 1024),
            ("1x8192", 1, 8192, 8192),
            ("chunk2048@6144", 1, 2048, 8192),
            ("chunk64@2048", 1, 64, 2112),  # a prompt's tail after a prefix hit
        ]
        fused_tokens = [1, 64, 8192]
    torch.manual_seed(0)
    gpu = "cpu (interpreter)" if args.smoke else torch.cuda.get_device_name()
    print(f"# {gpu}, torch {torch.__version__}, max_model_len {max_len}", flush=True)

    ceil = b.ceilings()
    if "decode" not in skip:
        bench_decode(b, shape, batches, ctx, max_len, args.sweep, ceil["hbm_bytes_per_s"])
    if "prefill" not in skip:
        bench_prefill(b, shape, prefill_cases, args.sweep, ceil["bf16_flops_per_s"])
    if "fused" not in skip:
        bench_fused(b, shape, fused_tokens, ceil["hbm_bytes_per_s"])

    meta = {
        "gpu": gpu,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": args.commit or _commit(),
        "command": " ".join(["python", *sys.argv]),
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**meta, "figures": b.figures, "best_configs": b.best}, indent=1))
    if not args.no_out and not args.smoke:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "a") as f:
            for fig in b.figures:
                f.write(json.dumps({**fig, "goal": None, **meta}) + "\n")

    print("\n# best configs: " + json.dumps(b.best))
    widths = [max(len(row[i]) for row in b.table) for i in range(5)] if b.table else []
    print(f"\n# kernels on {gpu} ({meta['date']}, {meta['commit']})")
    for row in b.table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


if __name__ == "__main__":
    main()
