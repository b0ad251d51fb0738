"""DeepSeek-V3 on one GPU: the MLA decode kernel and the fused MoE alone, then decode steps of the real
layer shape (random bf16 weights, ``--layers`` layers: the first dense, the rest MoE of 256 experts) at
each ``--batches`` size, against the bytes a step must read, and HF transformers' eager decode at batch 1.

    python bench/deepseek.py --out bench/results/deepseek.jsonl --commit <sha>
    python bench/deepseek.py --shape moonlight --batches 1,16 --skip-kernels --out ...   # a whole ~16B model
    python bench/deepseek.py --fp8 --batches 1 --skip-kernels --out ...   # float8 experts (no peer)
    python bench/deepseek.py --batches 1 --skip-kernels --skip-peer --mtp --out ...   # MTP k=1 at batch 1
    python bench/deepseek.py --batches 1 --skip-kernels --skip-peer --mtp --mtp-bigram --out ...  # drafts right
    python bench/deepseek.py --shape v32 --ctx 4096 --batches 1 --skip-kernels --skip-peer --out ...  # V3.2
    python bench/deepseek.py --ctx 4096 --block-size 64 --skip-kernels --skip-peer --out ...  # 64-token pages
    python bench/deepseek.py --shape v3_671b --fp8 --tp 8 --batches 1,8,64 --out ...  # the published model

With ``--tp N`` only decode runs, and a step's bytes are one GPU's: rank 0's shard of the weights and the
whole latent cache (every rank holds it), figures ``...decode.tpN.*`` with the GPU named ``Nx <GPU>``.

The ceilings are measured first, in the same process. A step's bytes: every weight except the routed
experts and the embedding table, plus the experts the router actually picked in a measured step (the
distinct ones per layer: 8 at batch 1), one embedding row per token and the latents the rows attend to
(V3.2: the latents of the positions the indexer keeps, at most ``index_topk`` a row, and the indexer's
own key for every position).
The MLA kernel's figure is its latent bytes over the copy rate (the issue's goal), the MoE's its expert
bytes over the streaming-read rate; V3.2's sparse rows (``index_topk`` 2048 of 8192 positions) are timed
beside the dense kernel over the whole context.
"""

from __future__ import annotations

import argparse
import gc
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
    graph_time_ms,
    greedy,
    make_near_bigram,
    measure_ceilings,
    start_decoding,
    stop_decoding,
    timed_decode,
    timed_steps_ms,
    write_word_tokenizer,
)  # fmt: skip

from pegainfer.layers.block_fp8 import BlockFP8Weight
from pegainfer.layers.moe import BlockScales
from pegainfer.model.model_loader import parameter_bytes
from pegainfer.ops import fused_moe
from pegainfer.testing.speculative import force_drafts
from pegainfer.text.tiny_tokenizer import write_tiny_tokenizer
from pegainfer_deepseek.mla_decode import (
    mla_decode_attention,
    mla_decode_attention_ref,
    mla_decode_attention_triton,
)
from pegainfer_deepseek.moe import MoE
from pegainfer_deepseek.published import FP8_QUANTIZATION, V3_LAYERS, V3_SHAPE, V3_VOCAB
from pegainfer_deepseek.tiny import deepseek_v3_config, deepseek_v32_config

#: DeepSeek-V3's published layer shapes (671B), with one dense layer before the MoE ones (published: three)
#: so that a few ``--layers`` are mostly MoE, and no MTP layer (``--mtp`` adds one); the layer count comes
#: from ``--layers``.
V3 = dict(V3_SHAPE, first_k_dense_replace=1, num_nextn_predict_layers=0)
#: A whole ~16B deepseek_v3-layout model that fits one GPU (about Moonlight-16B-A3B's shape).
MOONLIGHT = dict(
    hidden_size=2048, intermediate_size=11264, moe_intermediate_size=1408, first_k_dense_replace=1,
    num_hidden_layers=27, num_attention_heads=16, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
    n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.446, max_position_embeddings=8192,
    rms_norm_eps=1e-5, rope_theta=50000.0, rope_scaling=None, num_nextn_predict_layers=0,
    torch_dtype="bfloat16",
)  # fmt: skip
#: DeepSeek-V3.2's layer shapes: the V3 above with the DSA lightning indexer in every layer (as published).
V32 = dict(V3, index_n_heads=64, index_head_dim=128, index_topk=2048)
#: shape name -> (config keys, vocabulary, figure prefix)
SHAPES = {
    "v3": (V3, V3_VOCAB, "deepseek"),
    "v32": (V32, V3_VOCAB, "deepseek_v32"),
    "moonlight": (MOONLIGHT, 163840, "deepseek_moonlight"),
    # The whole published model (three dense layers, 58 MoE), FP8 only, over eight GPUs (``--tp 8``).
    "v3_671b": (
        dict(V3_SHAPE, num_hidden_layers=V3_LAYERS, num_nextn_predict_layers=0),
        V3_VOCAB,
        "deepseek_v3_671b",
    ),
}


def default_layers(name: str) -> int | None:
    """Layers a shape runs without ``--layers``: the whole model for Moonlight and the published V3 (their
    configs name their layers), four (one dense, three MoE) for the V3 and V3.2 layer shapes."""
    return None if name in ("moonlight", "v3_671b") else 4


def checkpoint_folder(
    shape: dict, vocab: int, layers: int | None, fp8: bool = False, full_vocab_tokenizer: bool = False
) -> Path:
    """config.json (with DeepSeek's block-FP8 quantization_config when ``fp8``: the routed experts then
    stay float8 in memory) and a tokenizer (over every id with ``full_vocab_tokenizer``, for serving);
    weights come from load_format=dummy."""
    folder = Path(tempfile.mkdtemp(prefix="deepseek-bench-"))
    write_tiny_tokenizer(folder)
    if full_vocab_tokenizer:
        write_word_tokenizer(folder, vocab)
    config = (deepseek_v32_config if "index_topk" in shape else deepseek_v3_config)(vocab, **shape)
    if layers is not None:
        config["num_hidden_layers"] = layers
    if fp8:
        config["quantization_config"] = dict(FP8_QUANTIZATION)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


#: (block_h, block_v, block_n, num_warps, num_stages[, tma]) tilings the MLA decode kernel is timed with;
#: the first is the kernel's own default (the dispatch takes ``TMA_TILING`` where it applies).
MLA_TILINGS = [
    (16, None, 64, 4, 3), (16, None, 32, 4, 2), (16, None, 64, 8, 3), (32, None, 64, 8, 2),
    (64, None, 32, 8, 2), (64, None, 32, 8, 2, True), (64, None, 64, 8, 1, True), (64, None, 64, 8, 2, True),
    (64, 256, 64, 4, 2, True), (128, 256, 32, 8, 2, True),
]  # fmt: skip


def tiling_name(tiling: tuple, rkv: int = 512) -> str:
    """A ``MLA_TILINGS`` entry's name in the figures (``block_v`` None: all ``rkv`` features)."""
    block_h, block_v, block_n, warps, stages, *tma = tiling
    return f"h{block_h}_v{block_v or rkv}_n{block_n}_w{warps}_s{stages}" + ("_tma" if any(tma) else "")


def mla_operands(batch: int, ctx: int, heads: int, rkv: int = 512, dr: int = 64, page: int = 64):
    """Random bf16 queries and latent cache of ``batch`` rows of ``ctx`` tokens over shuffled pages."""
    pages = batch * ctx // page
    cache = torch.randn(pages, page, rkv + dr, device="cuda", dtype=torch.bfloat16)
    tables = torch.randperm(pages, device="cuda", dtype=torch.int64).view(batch, -1).to(torch.int32)
    lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    q = torch.randn(batch, heads, rkv, device="cuda", dtype=torch.bfloat16) * 0.1
    q_pe = torch.randn(batch, heads, dr, device="cuda", dtype=torch.bfloat16) * 0.1
    return q, q_pe, cache, tables, lens


def bench_mla_kernel(batch: int, ctx: int, heads: int, copy_bw: float) -> list[dict]:
    """The tiling the engine's dispatch picks (``engine``: the ``{tag}.ms`` figure), then each of
    ``MLA_TILINGS`` (one that fails to compile or does not apply is reported and skipped), CUDA-graph timed,
    over 64-token pages (the size FlashMLA and vLLM's MLA backends use; ``cache.block_size=64``).
    At 128 heads (one GPU) the step is compute-bound: 2 · heads · (576 + 512) flops per latent read, so the
    tensor-core rate is reported beside the copy ratio; 16 heads is a GPU's share under tp=8."""
    rkv, dr = 512, 64
    q, q_pe, cache, tables, lens = mla_operands(batch, ctx, heads, rkv, dr)
    latent_bytes = batch * ctx * (rkv + dr) * 2
    ref = mla_decode_attention_ref(q, q_pe, cache, tables, lens, 0.1, max_seq_len=ctx)
    flops = 2 * heads * (rkv + dr + rkv) * batch * ctx

    def timed_form(name: str, run) -> dict:
        torch.testing.assert_close(run().float(), ref.float(), atol=2e-2, rtol=2e-2)
        ms = graph_time_ms(run)
        return {"name": name, "ms": ms, "copy_ratio": latent_bytes / (ms / 1e3) / copy_bw,
                "tflops": flops / (ms / 1e3) / 1e12}  # fmt: skip

    # The tiling the engine's dispatch picks for this shape.
    timed = [
        timed_form("engine", lambda: mla_decode_attention(q, q_pe, cache, tables, lens, 0.1, max_seq_len=ctx))
    ]
    for tiling in MLA_TILINGS:
        block_h, block_v, block_n, warps, stages, *tma = tiling
        knobs = dict(
            block_h=block_h,
            block_v=block_v,
            block_n=block_n,
            num_warps=warps,
            num_stages=stages,
            tma=any(tma),
        )

        def run(knobs=knobs):
            return mla_decode_attention_triton(q, q_pe, cache, tables, lens, 0.1, max_seq_len=ctx, **knobs)

        try:
            timed.append(timed_form(tiling_name(tiling, rkv), run))
        except Exception as exc:  # e.g. out of shared memory for this tiling on this GPU
            print(f"MLA tiling {knobs} skipped: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
    return timed


def bench_mla_sparse(batch: int, ctx: int, topk: int, heads: int, copy_bw: float) -> dict:
    """V3.2's decode attention at the kernel's defaults: ``topk`` random distinct positions a row
    (``indices``) against the dense kernel over all ``ctx``; the copy ratio counts the listed latents."""
    rkv, dr = 512, 64
    q, q_pe, cache, tables, lens = mla_operands(batch, ctx, heads, rkv, dr)
    indices = torch.stack([torch.randperm(ctx, device="cuda")[:topk] for _ in range(batch)]).to(torch.int32)
    ref = mla_decode_attention_ref(q, q_pe, cache, tables, lens, 0.1, max_seq_len=ctx, indices=indices)

    def run(indices=indices):
        return mla_decode_attention(q, q_pe, cache, tables, lens, 0.1, max_seq_len=ctx, indices=indices)

    torch.testing.assert_close(run().float(), ref.float(), atol=2e-2, rtol=2e-2)
    sparse_ms, dense_ms = graph_time_ms(run), graph_time_ms(lambda: run(None))
    ratio = batch * topk * (rkv + dr) * 2 / (sparse_ms / 1e3) / copy_bw
    return {"ms": sparse_ms, "dense_ms": dense_ms, "copy_ratio": ratio}


def bench_fused_moe(tokens: int, read_bw: float, fp8: bool = False, act8: bool = False) -> dict:
    """DeepSeek-V3's routed experts (256 of 7168 → 2048, top-8), bf16 or block-FP8 (128×128 tiles; ``act8``:
    W8A8, the activations quantized per token and tile)."""
    experts, hidden, inter, k = 256, 7168, 2048, 8
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    gate_up = (torch.randn(experts, 2 * inter, hidden, device="cuda") * 0.01).to(dtype)
    down = (torch.randn(experts, hidden, inter, device="cuda") * 0.01).to(dtype)
    scales = None
    if fp8:
        tiles_i, tiles_h = inter // 128, hidden // 128
        scales = BlockScales(
            torch.rand(experts, 2, tiles_i, tiles_h, device="cuda"), torch.rand(experts, tiles_h, tiles_i, device="cuda"),
            (128, 128), fp8_activations=act8,
        )  # fmt: skip
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(experts, device="cuda")[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, device="cuda")
    ms = graph_time_ms(lambda: fused_moe(x, weights, ids, gate_up, down, scales))
    touched = ids.unique().numel() * 3 * hidden * inter * gate_up.element_size()
    return {"ms": ms, "experts": ids.unique().numel(), "read_ratio": touched / (ms / 1e3) / read_bw}


def distinct_experts(llm, prompts_step) -> list[int]:
    """The distinct experts each MoE layer's router picks in one step (a hook, outside the timed steps).
    A graph replay runs no module code, so this one step takes the graphs' eager form (the same padded
    shapes and numbers)."""
    runner = llm.engine.executor.runner
    seen: list[int] = []

    def count(_module, _inputs, out) -> None:
        ids = out[1]  # GroupLimitedRouter: (weights, expert ids)
        if ids.dtype != torch.int64:
            raise RuntimeError(f"the router's second output is {ids.dtype}, not the int64 expert ids")
        seen.append(ids.unique().numel())

    routers = [m.gate for m in runner.model.modules() if isinstance(m, MoE)]
    hooks = [router.register_forward_hook(count) for router in routers]
    graphs = runner.graphs
    eager = graphs.eager if graphs is not None else None
    try:
        if graphs is not None:
            graphs.eager = True
        prompts_step()
    finally:
        if graphs is not None:
            graphs.eager = eager
        for h in hooks:
            h.remove()
    if len(seen) != len(routers):
        raise RuntimeError(
            f"{len(seen)} router calls for {len(routers)} MoE layers in the measured step: the floor needs "
            "each layer's experts once"
        )
    return seen


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def unread_scale_bytes(model: torch.nn.Module) -> float:
    """Bytes of the block-FP8 projections' scales a step does not need: a weight keeps one scale row per
    weight row, and rows cut from one of a checkpoint's 128 x 128 tiles repeat their tile's scales
    (``BlockFP8Weight.settle_scales``); a step needs each distinct row once (the checkpoint's own
    ``weight_scale_inv`` bytes), where the GEMMs load one or two a tile of rows."""
    unread = 0.0
    for m in model.modules():
        if isinstance(m, BlockFP8Weight):
            unread += (m.scale.shape[0] - torch.unique(m.scale, dim=0).shape[0]) * _nbytes(m.scale[0])
    return unread


def step_bytes(llm, batch: int, ctx: float, experts_per_layer: list[int], shape: dict) -> float:
    model = llm.engine.executor.runner.model
    total = parameter_bytes(model) - unread_scale_bytes(model)
    routed = per_expert = 0
    for m in model.modules():
        if isinstance(m, MoE):
            # A routed expert's bytes: its weights and, float8, its tile scales (read for chosen ones only).
            size = _nbytes(m.experts_gate_up, m.experts_down)
            if m.fp8_block:
                size += _nbytes(m.experts_gate_up_scale, m.experts_down_scale)
            routed += size
            per_expert = size / m.experts_gate_up.shape[0]
    embed = model.embed_tokens
    row = embed.shape[1] * embed.element_size()
    layers = len(experts_per_layer) + shape["first_k_dense_replace"]
    # The MLA kernel reads every latent up to a row's length (V3.2: at most index_topk of them); V3.2's
    # indexer reads its own key for every position.
    attended = min(ctx, shape.get("index_topk", ctx))
    per_row = attended * (shape["kv_lora_rank"] + shape["qk_rope_head_dim"]) + ctx * shape.get(
        "index_head_dim", 0
    )
    latents = batch * per_row * 2 * layers
    return (
        total
        - routed
        - embed.numel() * embed.element_size()
        + batch * row
        + sum(experts_per_layer) * per_expert
        + latents
    )


def bench_decode(llm, vocab: int, batch: int, ctx: int, steps: int, rng: random.Random) -> dict:
    engine = llm.engine
    prompts = [[rng.randrange(vocab) for _ in range(ctx)] for _ in range(batch)]
    ids = start_decoding(engine, f"d{batch}-{rng.random()}", prompts, greedy(steps + 64))
    experts = distinct_experts(llm, engine.step)
    step_ms = timed_steps_ms(engine, steps)
    check_all_running(engine, batch)
    stop_decoding(engine, ids)
    return {"step_ms": step_ms, "experts": experts, "ctx": ctx + 4 + steps / 2}


def bench_mtp(
    shape: dict, vocab: int, layers: int | None, ctx: int, tokens: int, bigram: bool = False
) -> dict:
    """Batch-1 greedy decode of ``tokens`` tokens with and without MTP drafting (k=1) on the same random
    weights (one MTP layer added): tokens/s and acceptance in bf16 with the module's own drafts and, on
    the same engine, with drafts forced to the plain run's output (right wherever the verification
    repeats it: what drafting gains when it is right); and whether the outputs are identical in float32.
    With random weights the module's own drafts are right about as often as chance: that run measures
    what drafting costs.

    Identity is checked in float32: in bf16 a verification's 16-row GEMMs and plain decode's one-row
    GEMMs round differently, enough to flip a random router's near ties (measured 2026-12-04, when the
    verification still attended in the expanded form: the first bf16 difference at token 30, where plain
    decode's top two were 0.22 nats apart). The float32 runs take two layers (the first dense, one MoE)
    and the MTP layer: four do not fit one H200 in float32. ``bigram``: every engine's weights made
    near-bigram first (``common.make_near_bigram``: the module's own drafts right)."""
    folders = {
        "bfloat16": checkpoint_folder({**shape, "num_nextn_predict_layers": 1}, vocab, layers),
        "float32": checkpoint_folder({**shape, "num_nextn_predict_layers": 1}, vocab, 2),
    }
    prompt = [random.Random(1).randrange(vocab) for _ in range(ctx)]
    runs = {}
    for k, dtype in ((0, "bfloat16"), (1, "bfloat16"), (0, "float32"), (1, "float32")):
        llm = build(
            folders[dtype], max_num_seqs=1, max_model_len=ctx + tokens + 64, speculative_tokens=k, dtype=dtype
        )
        if bigram:
            make_near_bigram(
                llm.engine.executor.runner.model, draft_input="mtp.0.eh_proj",
                copies={"mtp.0.embed_tokens": "embed_tokens", "mtp.0.head": "lm_head", "mtp.0.head_norm": "norm"},
                identity_norms=("mtp.0.enorm",), identity=1.0,
            )  # fmt: skip
        runs[k, dtype] = timed_decode(llm, prompt, tokens)
        if k and dtype == "bfloat16":
            force_drafts(llm, {tuple(prompt): prompt + runs[0, dtype][0]}, None)
            runs["forced", dtype] = timed_decode(llm, prompt, tokens)
        llm.engine.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    return {
        "identical": runs[0, "float32"][0] == runs[1, "float32"][0],
        "tok_per_s": runs[0, "bfloat16"][1],
        "mtp_tok_per_s": runs[1, "bfloat16"][1],
        "acceptance": runs[1, "bfloat16"][2],
        "forced_tok_per_s": runs["forced", "bfloat16"][1],
        "forced_acceptance": runs["forced", "bfloat16"][2],
    }


def bench_peer(folder: Path, vocab: int, ctx: int, steps: int) -> float:
    """transformers' DeepseekV3ForCausalLM, eager bf16, random weights, batch 1: ms per decode step."""
    from transformers import AutoConfig, DeepseekV3ForCausalLM

    config = AutoConfig.from_pretrained(folder)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = DeepseekV3ForCausalLM(config).eval()
    torch.set_default_dtype(torch.float32)
    ids = torch.randint(0, vocab, (1, ctx), device="cuda")
    with torch.no_grad():
        out = model(ids, use_cache=True)
        cache = out.past_key_values
        token = out.logits[:, -1:].argmax(-1)
        for _ in range(3):
            out = model(token, past_key_values=cache, use_cache=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            out = model(out.logits[:, -1:].argmax(-1), past_key_values=out.past_key_values, use_cache=True)
        torch.cuda.synchronize()
    del model, out
    return (time.perf_counter() - t0) * 1e3 / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="append the records to this JSONL file")
    parser.add_argument("--shape", default="v3", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=None, help="default: 4 for v3/v32, all for moonlight")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--skip-kernels", action="store_true", help="no MLA / fused MoE microbenchmarks")
    parser.add_argument("--fp8", action="store_true", help="a block-FP8 checkpoint: float8 routed experts")
    parser.add_argument(
        "--fp8-activations",
        action="store_true",
        help="with --fp8: W8A8 (model.fp8_activations=true), figures deepseek_fp8_w8a8.*",
    )
    parser.add_argument("--mtp", action="store_true", help="also batch-1 decode with MTP drafting (k=1)")
    parser.add_argument(
        "--mtp-bigram",
        action="store_true",
        help="MTP runs on near-bigram weights (drafts right; _near_bigram)",
    )
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="KV page size (default: the engine's); in the figure names",
    )
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--skip-peer", action="store_true")
    add_memory_args(parser, 0.9)
    parser.add_argument("--commit", default=None)
    parser.add_argument(
        "--tp", type=int, default=1, help="decode only, over this many GPUs (figures ...decode.tpN.*)"
    )
    args = parser.parse_args()
    if args.fp8_activations and not args.fp8:
        parser.error("--fp8-activations quantizes the activations of an FP8 checkpoint's GEMMs: add --fp8")
    if args.shape == "v3_671b" and not args.fp8:
        parser.error("--shape v3_671b runs in FP8 blocks (--fp8): 1.3 TB of bf16 fits no eight GPUs")
    if args.tp > 1:  # the kernels, the peer and MTP drafting are one-GPU figures
        args.skip_kernels = args.skip_peer = True
        args.mtp = False
    gpus = f"{args.tp}x {torch.cuda.get_device_name()}" if args.tp > 1 else None
    results = Results(args.out or Path(os.devnull), "python " + " ".join(sys.argv), args.commit, device=gpus)
    try:
        ceil = measure_ceilings()
        torch.cuda.empty_cache()
        copy_bw, read_bw = ceil["hbm_bytes_per_s"], ceil["decode_ceiling_bytes_per_s"]
        results.add("gpu.hbm_copy_bandwidth", copy_bw / 1e12, "TB/s")
        results.add("gpu.hbm_stream_read_bandwidth", ceil["hbm_read_bytes_per_s"] / 1e12, "TB/s")

        for heads in () if args.skip_kernels else (128, 16):
            tilings = bench_mla_kernel(64, 4096, heads, copy_bw)
            tag = "deepseek.mla_decode." + ("" if heads == 128 else f"h{heads}.") + "bs64_ctx4096"
            for t in tilings:
                results.add(f"{tag}.{t['name']}.ms", t["ms"], "ms")
                results.add(f"{tag}.{t['name']}.tflops", t["tflops"], "TFLOP/s")
            for t in [t for t in tilings if t["name"] == "engine"]:  # what the engine's dispatch runs
                results.add(f"{tag}.ms", t["ms"], "ms")
                results.add(f"{tag}.copy_bandwidth_ratio", t["copy_ratio"], "fraction", 0.7)
            if tilings:
                best = max(tilings, key=lambda t: t["copy_ratio"])
                results.add(
                    f"{tag}.best.{best['name']}.copy_bandwidth_ratio", best["copy_ratio"], "fraction", 0.7
                )
        for heads in () if args.skip_kernels else (128, 16):
            sparse = bench_mla_sparse(64, 8192, 2048, heads, copy_bw)
            tag = (
                "deepseek_v32.mla_decode_sparse."
                + ("" if heads == 128 else f"h{heads}.")
                + "bs64_ctx8192_top2048"
            )
            results.add(f"{tag}.ms", sparse["ms"], "ms")
            results.add(f"{tag}.dense_ctx8192_ms", sparse["dense_ms"], "ms")
            results.add(f"{tag}.copy_bandwidth_ratio", sparse["copy_ratio"], "fraction")
        for tokens in () if args.skip_kernels else (1, 32):
            for fp8, act8 in ((False, False), (True, False), (True, True)):
                moe = bench_fused_moe(tokens, read_bw, fp8, act8)
                tag = f"deepseek.fused_moe{'_fp8' if fp8 else ''}{'_w8a8' if act8 else ''}.bs{tokens}"
                results.add(f"{tag}.ms", moe["ms"], "ms")
                results.add(f"{tag}.bandwidth_utilization", moe["read_ratio"], "fraction")
        gc.collect()
        torch.cuda.empty_cache()

        shape, vocab, prefix = SHAPES[args.shape]
        layers = args.layers if args.layers is not None else default_layers(args.shape)
        folder = checkpoint_folder(shape, vocab, layers, args.fp8)
        if args.shape != "v3_671b":  # always FP8
            prefix += "_fp8" if args.fp8 else ""
        prefix += "_w8a8" if args.fp8_activations else ""
        batches = [int(b) for b in args.batches.split(",") if b]
        llm = build(
            folder,
            max_num_seqs=max(batches),
            max_model_len=args.ctx + args.steps + 128,
            block_size=args.block_size,
            tp=args.tp,
            model_keys={"fp8_activations": args.fp8_activations},
            gpu_memory_utilization=args.gpu_memory_utilization,
            max_num_batched_tokens=args.max_num_batched_tokens,
        )
        page = "" if args.block_size is None else f".page{args.block_size}"  # decode figures only
        rng = random.Random(0)
        for batch in batches:
            d = bench_decode(llm, vocab, batch, args.ctx, args.steps, rng)
            floor_ms = step_bytes(llm, batch, d["ctx"], d["experts"], shape) / read_bw * 1e3
            goals = {1: 0.75} if args.fp8 else {1: 0.8, 32: 0.6}
            goal = goals.get(batch) if args.shape == "v3" else None
            tag = f"{prefix}{page}.decode.{'' if args.tp == 1 else f'tp{args.tp}.'}bs{batch}"
            results.add(f"{tag}.step_ms", d["step_ms"], "ms")
            results.add(f"{tag}.floor_ms", floor_ms, "ms")
            results.add(f"{tag}.distinct_experts_per_layer", sum(d["experts"]) / len(d["experts"]), "experts")
            results.add(f"{tag}.bandwidth_utilization", floor_ms / d["step_ms"], "fraction", goal)
            rate_goal = 100.0 if args.shape == "v3_671b" and batch == 1 else None  # the eight-GPU issue's
            results.add(f"{tag}.tok_per_s", batch * 1e3 / d["step_ms"], "tok/s", rate_goal)
            if batch == 1:
                ours_bs1 = d["step_ms"]
        llm.engine.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
        if not args.skip_peer and not args.fp8 and 1 in batches:  # the peer runs the bf16 model
            peer = bench_peer(folder, vocab, args.ctx, args.steps)
            results.add(f"{prefix}.peer_hf.bs1.step_ms", peer, "ms")
            results.add(f"{prefix}.peer_hf.bs1.speedup", peer / ours_bs1, "x", 10.0)
        if args.mtp:
            m = bench_mtp(shape, vocab, layers, args.ctx, 64, args.mtp_bigram)
            weights = "_near_bigram" if args.mtp_bigram else ""
            own = f"{prefix}.mtp_k1{weights}.bs1"
            results.add(f"{own}.identical_greedy_fp32", float(m["identical"]), "bool", 1.0)
            results.add(f"{own}.acceptance", m["acceptance"], "fraction")
            results.add(f"{own}.tok_per_s", m["mtp_tok_per_s"], "tok/s")
            results.add(f"{own}.speedup", m["mtp_tok_per_s"] / m["tok_per_s"], "x")
            forced = f"{prefix}.mtp_k1_forced_right{weights}.bs1"
            results.add(f"{forced}.acceptance", m["forced_acceptance"], "fraction")
            results.add(f"{forced}.tok_per_s", m["forced_tok_per_s"], "tok/s")
            results.add(f"{forced}.speedup", m["forced_tok_per_s"] / m["tok_per_s"], "x")
    finally:  # what was measured is kept even if a later part fails
        if args.out:
            results.write()


if __name__ == "__main__":
    main()
