"""Qwen3-14B on one GPU, bf16, random weights in the real shape: decode, prefill, host overhead and the
HF transformers peer, against the ceilings measured in the same run.

    python bench/qwen3_14b.py --out bench/results/qwen3_14b.jsonl
    python bench/qwen3_14b.py --tp 2 --batches 1,64 --sync-batches "" --out ...   # decode over two GPUs
    python bench/qwen3_14b.py --skip-decode --skip-prefill --skip-peer --ngram 2,4 --out ...  # prompt lookup

With ``--tp N`` only decode runs (prefill and the peer are one-GPU figures): the bytes are one GPU's
shard (rank 0's weights, its KV heads) over the one GPU's ceiling, the 2-GPU roofline of the tensor-
parallel issue, in figures ``qwen3_14b.decode.tpN.*``; run it beside a ``--tp 1`` call on the same host.
``--ngram K[,K]`` times batch-1 greedy decode with prompt lookup (``speculative.method=ngram``) drafting
each K against drafting off, on near-bigram weights (``common.make_near_bigram``: the answer falls into
loops, so lookups find right drafts), the prompt holding the answer once already (prompt, its answer,
prompt again, as an edit of quoted text would); figures ``qwen3_14b.ngram_k{K}_near_bigram.bs1.*``
(tokens/s, speed-up over drafting off on the same weights, acceptance, whether greedy output is
identical).
Figures are appended to the JSONL file (one object per figure) and a short table is printed last.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import (
    Results,
    build,
    check_all_running,
    decode_graph_ms,
    greedy,
    make_near_bigram,
    measure_ceilings,
    start_decoding,
    stop_decoding,
    timed_decode,
    write_word_tokenizer,
)

from pegainfer.engine.llm import LLM
from pegainfer.kernels import skinny_gemm
from pegainfer.model.model_loader import parameter_bytes
from pegainfer.text.tiny_tokenizer import write_tiny_tokenizer

QWEN3_14B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 5120,
    "intermediate_size": 17408,
    "num_hidden_layers": 40,
    "num_attention_heads": 40,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "torch_dtype": "bfloat16",
    "hidden_act": "silu",
}


def checkpoint_folder(layers: int, full_vocab_tokenizer: bool = False) -> Path:
    """config.json (the real shape) and a tokenizer; weights come from load_format=dummy.

    ``full_vocab_tokenizer`` swaps the 1000-token test tokenizer for a word-level one over all 151936 ids
    (``common.write_word_tokenizer``), for the serving benchmark.
    """
    folder = Path(tempfile.mkdtemp(prefix="qwen3-14b-"))
    write_tiny_tokenizer(folder)
    if full_vocab_tokenizer:
        write_word_tokenizer(folder, QWEN3_14B["vocab_size"])
    (folder / "config.json").write_text(json.dumps({**QWEN3_14B, "num_hidden_layers": layers}))
    return folder


def random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(QWEN3_14B["vocab_size"]) for _ in range(n)]


def bench_decode(
    llm: LLM,
    batch: int,
    ctx: int,
    steps: int,
    rng: random.Random,
    async_scheduling: bool = True,
    profile: bool = False,
) -> dict[str, float]:
    """Wall time of engine steps with ``batch`` running requests at ``ctx`` tokens, their GPU part, and
    the host's part (wall time minus the time the engine waited for sampled tokens)."""
    engine = llm.engine
    engine.async_scheduling = async_scheduling
    # Room for the prefill's steps too: no request may finish before the timed steps end (graphs.run(batch)
    # below would replay finished rows).
    prompts = [random_prompt(rng, ctx) for _ in range(batch)]
    ids = start_decoding(engine, f"d{batch}", prompts, greedy(steps + 64))
    torch.cuda.synchronize()
    waited = engine.wait_time_s
    profiler = cProfile.Profile() if profile else None
    t0 = time.perf_counter()
    if profiler:
        profiler.enable()
    for _ in range(steps):
        engine.step()
    if profiler:
        profiler.disable()
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - t0) * 1e3 / steps
    check_all_running(engine, batch)
    host_ms = step_ms - (engine.wait_time_s - waited) * 1e3 / steps
    gpu_ms = decode_graph_ms(engine, batch)
    stop_decoding(engine, ids)  # its step reads the last pending step back, so the next run starts clean
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
    return {"step_ms": step_ms, "gpu_ms": gpu_ms, "host_ms": host_ms, "ctx": ctx + 3 + steps / 2}


def bench_prefill(llm: LLM, requests: int, length: int, rng: random.Random) -> float:
    """Milliseconds of the one step that prefills ``requests`` prompts of ``length`` tokens (median of 3)."""
    engine = llm.engine
    times = []
    for rep in range(4):
        for i in range(requests):
            engine.add_request(f"p{rep}-{i}", None, greedy(1), prompt_token_ids=random_prompt(rng, length))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
        while engine.has_unfinished_requests():
            engine.step()
    return sorted(times[1:])[1]  # the first repetition warms up


def bench_peer(layers: int, batches: list[int], ctx: int, steps: int) -> dict[int, float]:
    """HF transformers eager, bf16, same shape: milliseconds per decode step after a ``ctx`` prefill."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**{**QWEN3_14B, "num_hidden_layers": layers})
    with torch.device("cuda"):
        model = Qwen3ForCausalLM._from_config(config, dtype=torch.bfloat16).eval()
    out = {}
    with torch.no_grad():
        for batch in batches:
            ids = torch.randint(0, config.vocab_size, (batch, ctx), device="cuda")
            result = model(ids, use_cache=True)
            cache, token = result.past_key_values, result.logits[:, -1:].argmax(-1)
            for _ in range(3):
                result = model(token, past_key_values=cache, use_cache=True)
                token = result.logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(steps):
                result = model(token, past_key_values=cache, use_cache=True)
                token = result.logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
            out[batch] = (time.perf_counter() - t0) * 1e3 / steps
            del cache, result
            torch.cuda.empty_cache()
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return out


def bench_ngram(folder: Path, ctx: int, tokens: int, ks: list[int]) -> list[tuple[int, dict]]:
    """(k, row) for each k: batch-1 greedy decode of ``tokens`` tokens with prompt lookup drafting k a step,
    on near-bigram weights, after a prompt that holds its own answer once (prompt, answer, prompt); the
    speed-up is over drafting off on the same weights and prompt."""
    if not ks:
        return []
    rows, reference, base_rate = [], None, None
    for k in [0, *ks]:
        llm = build(
            folder, max_num_seqs=1, max_model_len=3 * ctx + 4 * tokens + 64, speculative_tokens=k,
            speculative_method="ngram",
        )  # fmt: skip
        # Near-bigram main model; it has no draft module, so only that part applies.
        make_near_bigram(
            llm.engine.executor.runner.model, draft_input="", copies={}, identity_norms=(), identity=1.0
        )
        if reference is None:
            start = random_prompt(random.Random(2), ctx)
            answer = llm.generate(prompt_token_ids=[start], sampling_params=greedy(tokens), use_tqdm=False)
            prompt = start + list(answer[0].outputs[0].token_ids) + start
        ids, tok_per_s, rate = timed_decode(llm, prompt, tokens)
        if reference is None:
            reference, base_rate = ids, tok_per_s
        else:
            row = {"tok_per_s": tok_per_s, "speedup": tok_per_s / base_rate, "acceptance": rate}
            rows.append((k, {**row, "identical": ids == reference}))
        llm.engine.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "qwen3_14b.jsonl")
    parser.add_argument("--layers", type=int, default=40, help="fewer layers for a quick smoke run")
    parser.add_argument("--batches", default="1,8,16,32,64,128")
    parser.add_argument("--ctx", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--skip-peer", action="store_true")
    parser.add_argument("--skip-prefill", action="store_true")
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument(
        "--sync-batches", default="1,64", help="also time these batches with async scheduling off"
    )
    parser.add_argument("--commit", default=None)
    parser.add_argument(
        "--skinny-rows",
        type=int,
        default=None,
        help="batch rows up to which projections use the skinny kernel",
    )
    parser.add_argument(
        "--ngram", default="", help="prompt-lookup drafts a step to time at batch 1, e.g. 2,4"
    )
    parser.add_argument("--profile-host", type=int, default=0, help="cProfile the host at this decode batch")
    parser.add_argument(
        "--tp",
        type=int,
        default=1,
        help="decode over this many GPUs (figures qwen3_14b.decode.tpN.*: one GPU's shard of the bytes)",
    )
    args = parser.parse_args()
    if args.tp > 1:
        args.skip_prefill = args.skip_peer = True
    if args.skinny_rows is not None:
        skinny_gemm.DISPATCH_ROWS = args.skinny_rows
    batches = [int(b) for b in args.batches.split(",")]
    results = Results(args.out, "python " + " ".join(sys.argv), args.commit)
    ceil = measure_ceilings()
    torch.cuda.empty_cache()
    bw, flops_rate = ceil["decode_ceiling_bytes_per_s"], ceil["bf16_flops_per_s"]
    results.add("gpu.hbm_copy_bandwidth", ceil["hbm_bytes_per_s"] / 1e12, "TB/s")
    results.add("gpu.hbm_stream_read_bandwidth", ceil["hbm_read_bytes_per_s"] / 1e12, "TB/s")
    results.add("gpu.bf16_matmul", flops_rate / 1e12, "TFLOP/s")

    rng = random.Random(0)
    folder = checkpoint_folder(args.layers)
    cfg = {**QWEN3_14B, "num_hidden_layers": args.layers}
    # One GPU's share: its KV heads (one, replicated, past as many ranks as heads), its shard of every
    # weight (rank 0's model, here).
    kv_per_token = args.layers * 2 * max(1, cfg["num_key_value_heads"] // args.tp) * cfg["head_dim"] * 2
    table = []
    decode = {}
    tp = "" if args.tp == 1 else f"tp{args.tp}."  # in the decode figures' names
    llm = build(folder, max_num_seqs=max(batches), max_model_len=args.ctx + args.steps + 128, tp=args.tp)
    model = llm.engine.executor.runner.model
    weight_bytes = parameter_bytes(model)
    embed_bytes = model.embed_tokens.numel() * model.embed_tokens.element_size()
    for batch in [] if args.skip_decode else batches:
        d = bench_decode(llm, batch, args.ctx, args.steps, rng, profile=batch == args.profile_host)
        decode[batch] = d
        # Each step reads every weight once (the embedding table only for the batch's rows) and the KV.
        read = weight_bytes - embed_bytes + batch * d["ctx"] * kv_per_token
        util = read / (d["step_ms"] / 1e3) / bw
        goal = ({1: 0.9, 64: 0.8} if args.tp == 1 else {1: 0.75, 64: 0.7}).get(batch)
        name = f"qwen3_14b.decode.{tp}bs{batch}"
        results.add(f"{name}.step_ms", d["step_ms"], "ms")
        if args.tp == 1:  # rank 0's graph alone cannot run: its all-reduces wait for the other ranks
            results.add(f"{name}.gpu_ms", d["gpu_ms"], "ms")
        results.add(f"{name}.tok_per_s", batch * 1e3 / d["step_ms"], "tok/s")
        results.add(f"{name}.bandwidth_utilization", util, "fraction", goal)
        results.add(f"{name}.host_ms", d["host_ms"], "ms")
        table.append(
            f"decode bs{batch:<4} {d['step_ms']:8.2f} ms/step (GPU {d['gpu_ms']:6.2f}, host {d['host_ms']:5.2f})  "
            f"{batch * 1e3 / d['step_ms']:9.1f} tok/s  bandwidth {util:6.1%}"
        )
    for batch in [] if args.skip_decode else [int(b) for b in args.sync_batches.split(",") if b]:
        d = bench_decode(llm, batch, args.ctx, args.steps, rng, async_scheduling=False)
        read = weight_bytes - embed_bytes + batch * d["ctx"] * kv_per_token
        util = read / (d["step_ms"] / 1e3) / bw
        results.add(f"qwen3_14b.decode_sync.{tp}bs{batch}.step_ms", d["step_ms"], "ms")
        results.add(f"qwen3_14b.decode_sync.{tp}bs{batch}.bandwidth_utilization", util, "fraction")
        table.append(
            f"decode bs{batch:<4} {d['step_ms']:8.2f} ms/step with async scheduling off ({util:6.1%})"
        )
    if decode:
        host_batch = 64 if 64 in decode else batches[-1]
        host_ms = decode[host_batch]["host_ms"]
        results.add(f"qwen3_14b.host.{tp}bs{host_batch}.cpu_ms_per_step", host_ms, "ms", 1.0)
        table.append(f"host time at bs{host_batch}: {host_ms:.2f} ms/step (wall minus waits for the GPU)")
    del llm
    gc.collect()
    torch.cuda.empty_cache()

    if not args.skip_prefill:
        # Its own engine: prompts of 8192 tokens need a longer max_model_len than the decode runs.
        llm = build(folder, max_num_seqs=32, max_model_len=8192 + 64)
        params = (
            weight_bytes / 2 - cfg["vocab_size"] * cfg["hidden_size"] * 2
        )  # matmul weights, no embeddings
        for requests, length in ((1, 8192), (8, 1024), (32, 512)):
            ms = bench_prefill(llm, requests, length, rng)
            tokens = requests * length
            attn = (
                4
                * args.layers
                * cfg["num_attention_heads"]
                * cfg["head_dim"]
                * requests
                * length
                * length
                / 2
            )
            flops = 2 * params * tokens + attn + 2 * cfg["vocab_size"] * cfg["hidden_size"] * requests
            mfu = flops / (ms / 1e3) / flops_rate
            name = f"{requests}x{length}"
            results.add(f"qwen3_14b.prefill.{name}.tok_per_s", tokens * 1e3 / ms, "tok/s")
            results.add(f"qwen3_14b.prefill.{name}.mfu", mfu, "fraction", 0.65 if name == "8x1024" else None)
            table.append(f"prefill {name:<8} {ms:8.1f} ms  {tokens * 1e3 / ms:9.0f} tok/s  MFU {mfu:6.1%}")
        del llm
    del model
    gc.collect()
    torch.cuda.empty_cache()

    for k, row in bench_ngram(folder, args.ctx, args.steps, [int(k) for k in args.ngram.split(",") if k]):
        name = f"qwen3_14b.ngram_k{k}_near_bigram.bs1"
        results.add(f"{name}.tok_per_s", row["tok_per_s"], "tok/s")
        results.add(f"{name}.speedup", row["speedup"], "x")
        results.add(f"{name}.acceptance", row["acceptance"], "fraction")
        results.add(f"{name}.identical_greedy", float(row["identical"]), "bool")
        table.append(
            f"prompt lookup k={k}: {row['tok_per_s']:.1f} tok/s, {row['speedup']:.2f}x, acceptance "
            f"{row['acceptance']:.2f}, greedy identical {row['identical']}"
        )

    if not args.skip_peer:
        peer = bench_peer(args.layers, [1, 16], args.ctx, 16)
        for batch, ms in peer.items():
            results.add(f"qwen3_14b.peer_hf.bs{batch}.step_ms", ms, "ms")
            ours = decode.get(batch)
            if ours is None:
                continue
            speedup = ms / ours["step_ms"]
            results.add(f"qwen3_14b.peer_hf.bs{batch}.speedup", speedup, "x", {1: 10.0, 16: 3.0}[batch])
            table.append(f"HF eager bs{batch}: {ms:.1f} ms/step -> pegainfer {speedup:.1f}x faster")
    results.write()
    print(
        f"\nceilings: HBM copy {ceil['hbm_bytes_per_s'] / 1e12:.2f} TB/s, streaming read "
        f"{ceil['hbm_read_bytes_per_s'] / 1e12:.2f} TB/s (decode ceiling {bw / 1e12:.2f}), bf16 {flops_rate / 1e12:.0f} TFLOP/s; "
        f"weights read per step {(weight_bytes - embed_bytes) / 1e9:.2f} GB "
        f"(floor {(weight_bytes - embed_bytes) / bw * 1e3:.2f} ms)"
    )
    print("\n".join(table))


if __name__ == "__main__":
    main()
