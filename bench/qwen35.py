"""Qwen3.5 dense on one GPU, bf16, random weights in a real shape: decode ms/step against the streaming-read
ceiling measured in the same run, prefill with fla-core's chunked kernels and with the torch chunked form,
and HF transformers eager as the peer at batch 1.

    python bench/qwen35.py                          # the 9B-style shape, batches 1 and 16, prints a table
    python bench/qwen35.py --shapes 9b,27b --out bench/results/qwen35.jsonl   # also appends the records
    python bench/qwen35.py --shapes 27b --batches 1 --tp 2 --out ...   # decode over two GPUs

Shapes: ``9b`` is transformers' ``Qwen3_5TextConfig`` defaults (the "Qwen3.5-9B style" configuration:
hidden 4096, 32 layers, GDN 16 key / 32 value heads of 128, attention 16/4 heads of 256); ``27b`` is a
Qwen3.5-27B-like shape (hidden 5120, 64 layers; the other sizes as listed in ``SHAPES``, check them
against the published config before quoting figures). Weights come from ``model.load_format=dummy``.

A decode step reads every weight once (the embedding table only for the batch's rows), the KV of the
full-attention layers and, per row, each GDN layer's fp32 state (read and written) and conv window: that
many bytes at the measured HBM copy bandwidth is the ceiling (``floor_ms``); ``bandwidth_utilization`` is
``floor_ms / step_ms``. With ``--tp N`` only decode runs and the bytes are one GPU's shard (rank 0's
weights, its share of the KV and GDN heads): figures ``qwen35_S.decode.tpN.*``. ``--reference-gdn`` also times decode with the GDN decode rows on the torch
reference (``PEGAINFER_QWEN35_GDN_KERNELS=0``), for the kernels' share.

``35b_a3b`` is transformers' ``Qwen3_5MoeTextConfig`` defaults (hidden 2048, 40 layers, 256 experts of 512,
top 8, a shared expert of 512): its floor counts of the routed experts only the distinct ones the router
chose in one measured step (``distinct_experts_per_layer``). Prefill also reports ``mfu``: the step's matmul
flops (``prefill_flops``) over its time, against the bf16 matmul rate measured in the same run.

``--mtp 1,2,3`` adds the shape's one-layer MTP module and decodes one request greedily with drafting off and
with each k (``bench_mtp``): whether the tokens are identical, the acceptance, tokens/s; and again with the
drafts forced to that run's own output (``_forced_right``). In bf16 with random weights neither is what it
would be on a trained model: the top logits are near ties, so the verification path and the decode graph
part within a few tokens, and a token verified as a chunk's second row is not bit-identical to the same
token as the next chunk's first row, so even forced drafts are rarely accepted (docs/benchmarks.md).
``--mtp-bigram`` runs the same on near-bigram weights (``common.make_near_bigram``, figures
``..._near_bigram``): the next token is then clear-cut and the module's own drafts right, so the speed-up
is that of drafting at high acceptance.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import (
    Results,
    add_memory_args,
    build,
    check_all_running,
    decode_graph_ms,
    greedy,
    make_near_bigram,
    measure_ceilings,
    start_decoding,
    stop_decoding,
    timed_decode,
    timed_steps_ms,
    write_word_tokenizer,
)  # fmt: skip

from pegainfer.engine.llm import LLM
from pegainfer.model.model_loader import parameter_bytes
from pegainfer.testing.speculative import force_drafts
from pegainfer.text.tiny_tokenizer import write_tiny_tokenizer

BASE = {
    "architectures": ["Qwen3_5ForCausalLM"],
    "model_type": "qwen3_5_text",
    "vocab_size": 248320,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "rope_parameters": {"rope_theta": 10000000.0, "partial_rotary_factor": 0.25, "rope_type": "default"},
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "head_dim": 256,
    "full_attention_interval": 4,
    "torch_dtype": "bfloat16",
}
SHAPES = {
    # transformers' Qwen3_5TextConfig defaults ("Qwen3.5-9B style").
    "9b": {
        **BASE,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 32,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
    },
    # Qwen3.5-27B-like: hidden 5120 and 64 layers; 24/4 attention heads, 16 key / 48 value GDN heads.
    "27b": {
        **BASE,
        "hidden_size": 5120,
        "intermediate_size": 17408,
        "num_hidden_layers": 64,
        "num_attention_heads": 24,
        "num_key_value_heads": 4,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 48,
    },
    # transformers' Qwen3_5MoeTextConfig defaults ("Qwen3.5-35B-A3B style"): 256 experts of 512, top 8.
    "35b_a3b": {
        **BASE,
        "architectures": ["Qwen3_5MoeForCausalLM"],
        "model_type": "qwen3_5_moe_text",
        "hidden_size": 2048,
        "num_hidden_layers": 40,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
    },
}


def checkpoint_folder(shape: dict, full_vocab_tokenizer: bool = False) -> Path:
    """config.json and a tokenizer (over every id with ``full_vocab_tokenizer``, for serving); weights come
    from load_format=dummy."""
    folder = Path(tempfile.mkdtemp(prefix="qwen35-bench-"))
    write_tiny_tokenizer(folder)
    if full_vocab_tokenizer:
        write_word_tokenizer(folder, shape["vocab_size"])
    (folder / "config.json").write_text(json.dumps(shape))
    return folder


def prompt(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def distinct_experts(llm, step) -> list[int]:
    """The distinct routed experts each MoE layer chooses in one step (counted around ``SparseMoE.route``, outside
    the timed steps). A graph replay runs no Python, so this step takes the graphs' eager form (the same
    padded shapes and numbers)."""
    from pegainfer_qwen35.moe import SparseMoE

    seen: list[int] = []
    route = SparseMoE.route

    def counting(self, *args, **kwargs):
        # (normed rows, weights, ids: the top k, then the shared pieces)
        routed = route(self, *args, **kwargs)
        ids = routed[2]
        if ids.dtype != torch.int64:
            raise RuntimeError(f"SparseMoE.route's third output is {ids.dtype}, not the int64 expert ids")
        seen.append(ids[:, : self.config.num_experts_per_tok].unique().numel())
        return routed

    graphs = llm.engine.executor.runner.graphs
    eager = graphs.eager if graphs is not None else None
    SparseMoE.route = counting
    try:
        if graphs is not None:
            graphs.eager = True
        step()
    finally:
        SparseMoE.route = route
        if graphs is not None:
            graphs.eager = eager
    return seen


def step_bytes(
    model, batch: int, ctx: float, experts_per_layer: list[int] | None = None, tp: int = 1
) -> float:
    """Bytes one decode step must move on one GPU: weights (``model`` is one rank's shard; of the MoE
    layers' routed experts only those the step's router chose, ``experts_per_layer``), KV of the
    full-attention layers (the rank's heads), GDN slot states (their heads split over ``tp`` ranks)."""
    from pegainfer_qwen35.moe import SparseMoE

    c = model.config
    weights = parameter_bytes(model)
    moes = [m for m in model.modules() if isinstance(m, SparseMoE)]
    if moes:
        if experts_per_layer is None or len(experts_per_layer) != len(moes):
            raise RuntimeError(f"expert counts {experts_per_layer} do not cover the {len(moes)} MoE layers")
        for m, used in zip(moes, experts_per_layer, strict=True):
            size = sum(t.numel() * t.element_size() for t in (m.experts_gate_up, m.experts_down))
            # The stacked experts end with the shared expert's pieces, which every token runs.
            weights -= size - (used + m.shard.shared_pieces) * size // m.experts_gate_up.shape[0]
    embed = model.embed_tokens
    if model.lm_head is not None:  # a step reads its tokens' rows of the table; tied, the head reads it all
        weights -= embed.numel() * embed.element_size() - batch * embed.shape[1] * embed.element_size()
    full, linear = len(c.layers_of("full_attention")), len(c.layers_of("linear_attention"))
    # A rank's KV heads: its share, or one head replicated where there are fewer heads than ranks.
    kv = full * batch * ctx * 2 * model.shard.num_kv_heads * c.head_dim * 2
    state = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim
    window = c.conv_dim * (c.conv_kernel - 1)
    recurrent = linear * batch * 2 * 4 * (state + window)  # fp32, read and written
    return weights + kv + recurrent / tp


def bench_decode(llm: LLM, vocab: int, batch: int, ctx: int, steps: int, rng: random.Random) -> dict:
    engine = llm.engine
    prompts = [prompt(rng, vocab, ctx) for _ in range(batch)]
    ids = start_decoding(engine, f"d{batch}-{rng.random()}", prompts, greedy(steps + 64))
    experts = distinct_experts(llm, engine.step) if llm.engine.executor.runner.model.config.is_moe else None
    waited = engine.wait_time_s
    step_ms = timed_steps_ms(engine, steps)
    check_all_running(engine, batch)
    host_ms = step_ms - (engine.wait_time_s - waited) * 1e3 / steps
    gpu_ms = decode_graph_ms(engine, batch)
    stop_decoding(engine, ids)
    return {
        "step_ms": step_ms,
        "gpu_ms": gpu_ms,
        "host_ms": host_ms,
        "ctx": ctx + 3 + (experts is not None) + steps / 2,
        "experts": experts,
    }


def bench_prefill(llm: LLM, vocab: int, requests: int, length: int, rng: random.Random) -> float:
    """Milliseconds of the one step that prefills ``requests`` prompts of ``length`` (median of 3)."""
    engine = llm.engine
    times = []
    for rep in range(4):
        for i in range(requests):
            engine.add_request(
                f"p{rep}-{i}-{rng.random()}", None, greedy(1), prompt_token_ids=prompt(rng, vocab, length)
            )
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
        while engine.has_unfinished_requests():
            engine.step()
    return sorted(times[1:])[1]


def prefill_flops(model, requests: int, length: int) -> float:
    """The matmul flops of one prefill step over ``requests`` prompts of ``length``: every projection on
    every token (of the routed experts, the k chosen of E), lm_head on each prompt's last token, and the
    causal attention of the full-attention layers (QK and PV: 2 L^2 d a head); the GDN recurrence's own
    few flops a token are left out."""
    from pegainfer_qwen35.moe import SparseMoE

    c = model.config
    skip = {id(model.embed_tokens)} | ({id(model.lm_head)} if model.lm_head is not None else set())
    per_token = sum(p.numel() for p in model.parameters() if p.dim() >= 2 and id(p) not in skip)
    for m in model.modules():
        if isinstance(m, SparseMoE):
            stacked = m.experts_gate_up.numel() + m.experts_down.numel()  # routed, then the shared pieces
            active = c.num_experts_per_tok + m.shard.shared_pieces
            per_token -= stacked - stacked * active // m.experts_gate_up.shape[0]
    head = model.embed_tokens if model.lm_head is None else model.lm_head
    attention = len(c.layers_of("full_attention")) * 2 * length**2 * c.num_heads * c.head_dim
    return 2 * per_token * requests * length + 2 * head.numel() * requests + attention * requests


def fla_available() -> bool:
    from pegainfer_qwen35.gated_deltanet import fla_chunk_rule

    return fla_chunk_rule() is not None


def _peer_step(model, result, cache_kw: str):
    token = result.logits[:, -1:].argmax(-1)
    cache = getattr(result, "cache", None) or result.past_key_values
    return model(token, use_cache=True, **{cache_kw: cache})


def bench_mtp(shape: dict, ctx: int, tokens: int, ks: list[int], bigram: bool = False) -> list[dict]:
    """Batch-1 greedy decode of ``tokens`` tokens after a ``ctx``-token prompt, with the shape's MTP module
    added: drafting off, then each k with the module's own drafts and, on the same engine, with drafts
    forced to that run's own output (right wherever the verification repeats itself). Decode tokens/s
    leaves the prompt's prefill out (a ``max_tokens=1`` run of the same engine, subtracted). ``bigram``:
    every engine's weights made near-bigram first (``common.make_near_bigram``: drafts right)."""
    folder = checkpoint_folder({**shape, "mtp_num_hidden_layers": 1})
    prompt = [random.Random(1).randrange(shape["vocab_size"]) for _ in range(ctx)]

    rows, reference = [], []
    for k in [0, *ks]:
        llm = build(folder, max_num_seqs=1, max_model_len=ctx + tokens + 64, speculative_tokens=k)
        if bigram:
            make_near_bigram(
                llm.engine.executor.runner.model, draft_input="mtp.0.fc", copies={"mtp.0.norm": "norm"},
                identity_norms=("mtp.0.pre_fc_norm_embedding",), identity=0.0,
            )  # fmt: skip
        ids, tok_per_s, rate = timed_decode(llm, prompt, tokens)
        reference = reference or ids
        rows.append(
            {
                "k": k,
                "forced": False,
                "identical": ids == reference,
                "acceptance": rate,
                "tok_per_s": tok_per_s,
            }
        )
        if k:
            force_drafts(llm, {tuple(prompt): prompt + ids}, None)
            forced, tok_per_s, rate = timed_decode(llm, prompt, tokens)
            rows.append(
                {
                    "k": k,
                    "forced": True,
                    "identical": forced == reference,
                    "acceptance": rate,
                    "tok_per_s": tok_per_s,
                }
            )
        llm.engine.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def bench_peer(shape: dict, ctx: int, steps: int, device: str = "cuda") -> float:
    """HF transformers eager, bf16, same shape, batch 1: ms per decode step after a ``ctx`` prefill."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    keys = {k: v for k, v in shape.items() if k not in ("architectures", "model_type", "torch_dtype")}
    config = Qwen3_5TextConfig(**keys)
    with torch.device(device):
        model = Qwen3_5ForCausalLM._from_config(config, dtype=torch.bfloat16).eval()
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        ids = torch.randint(0, config.vocab_size, (1, ctx), device=device)
        result = model(ids, use_cache=True)
        for _ in range(3):
            result = _peer_step(model, result, cache_kw)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            result = _peer_step(model, result, cache_kw)
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3 / steps
    del model, result
    gc.collect()
    torch.cuda.empty_cache()
    return ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="append the records to this JSONL file")
    parser.add_argument("--shapes", default="9b", help="comma-separated: 9b, 27b, 35b_a3b")
    parser.add_argument("--layers", type=int, default=None, help="fewer layers for a quick smoke run")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--prefill", default="1x512,8x512,1x4096", help="requests x length, '' for none")
    parser.add_argument("--reference-gdn", action="store_true", help="also decode with the GDN reference")
    parser.add_argument("--skip-peer", action="store_true")
    parser.add_argument("--peer-shapes", default="9b", help="shapes that get the HF peer at batch 1")
    parser.add_argument("--mtp", default="", help="k values for MTP drafting at batch 1, e.g. 1,2,3")
    parser.add_argument("--mtp-tokens", type=int, default=128)
    parser.add_argument(
        "--mtp-bigram",
        action="store_true",
        help="MTP runs on near-bigram weights (drafts right; _near_bigram)",
    )
    add_memory_args(parser, 0.85)
    parser.add_argument("--commit", default=None)
    parser.add_argument(
        "--tp", type=int, default=1, help="decode only, over this many GPUs (figures qwen35_S.decode.tpN.*)"
    )
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",") if b]
    if args.tp > 1:  # prefill, MTP, the GDN reference and the peer are one-GPU figures
        args.prefill, args.mtp, args.reference_gdn, args.skip_peer = "", "", False, True
    results = Results(args.out or Path(os.devnull), "python " + " ".join(sys.argv), args.commit)
    ceil = measure_ceilings()
    torch.cuda.empty_cache()
    bw = ceil["decode_ceiling_bytes_per_s"]
    results.add("gpu.hbm_copy_bandwidth", ceil["hbm_bytes_per_s"] / 1e12, "TB/s")
    results.add("gpu.hbm_stream_read_bandwidth", ceil["hbm_read_bytes_per_s"] / 1e12, "TB/s")
    results.add("gpu.bf16_matmul", ceil["bf16_flops_per_s"] / 1e12, "TFLOP/s")
    table = [
        f"ceilings: HBM copy {ceil['hbm_bytes_per_s'] / 1e12:.2f} TB/s, streaming read "
        f"{ceil['hbm_read_bytes_per_s'] / 1e12:.2f} TB/s (decode ceiling {bw / 1e12:.2f}), bf16 {ceil['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s"
    ]
    rng = random.Random(0)
    prefills = [tuple(int(x) for x in p.split("x")) for p in args.prefill.split(",") if p]
    for name in args.shapes.split(","):
        shape = dict(SHAPES[name])
        if args.layers:
            shape["num_hidden_layers"] = args.layers
        vocab = shape["vocab_size"]
        folder = checkpoint_folder(shape)
        longest = max([args.ctx + args.steps + 128] + [n for _, n in prefills])
        variants = [("kernels", "1")] + ([("reference_gdn", "0")] if args.reference_gdn else [])
        decode: dict[int, dict] = {}
        for variant, switch in variants:
            os.environ["PEGAINFER_QWEN35_GDN_KERNELS"] = switch  # read at every forward (and capture)
            llm = build(
                folder,
                max_num_seqs=max(batches),
                max_model_len=longest + 64,
                gpu_memory_utilization=args.gpu_memory_utilization,
                tp=args.tp,
                max_num_batched_tokens=args.max_num_batched_tokens,
            )
            model = llm.engine.executor.runner.model
            tag = f"qwen35_{name}" + ("" if variant == "kernels" else f".{variant}")
            # The memory plan of this GPU (rank 0's under tp): what the step's transients take, what is
            # left for KV pages and state slots.
            plan = llm.engine.executor.plan
            transient_gb, kv_tokens = sum(plan.transients.values()) / 1e9, plan.num_blocks * plan.block_size
            results.add(f"{tag}.plan.transient_gb", transient_gb, "GB")
            results.add(f"{tag}.plan.kv_tokens", kv_tokens, "tokens")
            results.add(f"{tag}.plan.state_slots", plan.num_state_slots, "slots")
            table.append(
                f"{tag:<24} plan: transients {transient_gb:.2f} GB, {kv_tokens} KV tokens, "
                f"{plan.num_state_slots} state slots"
            )
            for batch in batches:
                d = bench_decode(llm, vocab, batch, args.ctx, args.steps, rng)
                floor_ms = step_bytes(model, batch, d["ctx"], d["experts"], args.tp) / bw * 1e3
                util = floor_ms / d["step_ms"]
                if variant == "kernels":
                    decode[batch] = d
                key = f"{tag}.decode.{'' if args.tp == 1 else f'tp{args.tp}.'}bs{batch}"
                results.add(f"{key}.step_ms", d["step_ms"], "ms")
                if args.tp == 1:
                    results.add(f"{key}.gpu_ms", d["gpu_ms"], "ms")
                results.add(f"{key}.floor_ms", floor_ms, "ms")
                results.add(f"{key}.bandwidth_utilization", util, "fraction")
                results.add(f"{key}.host_ms", d["host_ms"], "ms")
                if d["experts"]:
                    mean = sum(d["experts"]) / len(d["experts"])
                    results.add(f"{key}.distinct_experts_per_layer", mean, "experts")
                table.append(
                    f"{tag:<24} decode bs{batch:<3} {d['step_ms']:7.2f} ms/step (GPU {d['gpu_ms']:6.2f}, "
                    f"host {d['host_ms']:5.2f}; floor {floor_ms:6.2f})  {batch * 1e3 / d['step_ms']:8.1f} "
                    f"tok/s  bandwidth {util:6.1%}"
                )
            if variant == "kernels":
                fla = fla_available()
                for requests, length in prefills:
                    rules = (["fla"] if fla else []) + ["torch"]
                    for rule in rules:
                        os.environ["PEGAINFER_QWEN35_FLA"] = "1" if rule == "fla" else "0"
                        ms = bench_prefill(llm, vocab, requests, length, rng)
                        tokens = requests * length
                        key = f"{tag}.prefill_{rule}.{requests}x{length}"
                        results.add(f"{key}.ms", ms, "ms")
                        results.add(f"{key}.tok_per_s", tokens * 1e3 / ms, "tok/s")
                        mfu = prefill_flops(model, requests, length) / (ms / 1e3) / ceil["bf16_flops_per_s"]
                        results.add(f"{key}.mfu", mfu, "fraction")
                        table.append(
                            f"{tag:<24} prefill {requests}x{length:<5} {rule:<5} {ms:8.1f} ms "
                            f"{tokens * 1e3 / ms:9.0f} tok/s  MFU {mfu:6.1%}"
                        )
                    os.environ.pop("PEGAINFER_QWEN35_FLA", None)
                if not fla:
                    table.append(f"{tag:<24} prefill: fla-core not importable, torch chunked form only")
            llm.engine.shutdown()
            del llm, model  # the next engine and the peer need the memory back
            gc.collect()
            torch.cuda.empty_cache()
        os.environ.pop("PEGAINFER_QWEN35_GDN_KERNELS", None)
        ks = [int(k) for k in args.mtp.split(",") if k]
        if ks:
            rows = bench_mtp(shape, args.ctx, args.mtp_tokens, ks, args.mtp_bigram)
            plain = rows[0]["tok_per_s"]
            weights = "_near_bigram" if args.mtp_bigram else ""
            results.add(f"qwen35_{name}.mtp_off{weights}.bs1.tok_per_s", plain, "tok/s")
            for row in rows[1:]:
                forced = "_forced_right" if row["forced"] else ""
                key = f"qwen35_{name}.mtp_k{row['k']}{forced}{weights}.bs1"
                results.add(f"{key}.identical_greedy", float(row["identical"]), "bool", 1.0)
                results.add(f"{key}.acceptance", row["acceptance"], "fraction")
                results.add(f"{key}.tok_per_s", row["tok_per_s"], "tok/s")
                results.add(f"{key}.speedup", row["tok_per_s"] / plain, "x")
                table.append(
                    f"{key:<36} {row['tok_per_s']:7.1f} tok/s ({row['tok_per_s'] / plain:4.2f}x of "
                    f"{plain:.1f})  acceptance {row['acceptance']:.2f}  identical {row['identical']}"
                )
        if not args.skip_peer and name in args.peer_shapes.split(","):
            ms = bench_peer(shape, args.ctx, 16)
            results.add(f"qwen35_{name}.peer_hf.bs1.step_ms", ms, "ms")
            ours = decode.get(1)
            line = f"qwen35_{name:<17} HF eager bs1: {ms:.1f} ms/step"
            if ours:
                results.add(f"qwen35_{name}.peer_hf.bs1.speedup", ms / ours["step_ms"], "x")
                line += f" -> pegainfer {ms / ours['step_ms']:.1f}x faster"
            table.append(line)
    if args.out:
        results.write()
    print("\n" + "\n".join(table))


if __name__ == "__main__":
    main()
