"""The memory plan of one tensor-parallel rank of the published DeepSeek-V3 (671B, FP8 128x128 blocks) on
an H200, computed on the CPU: the rank's model built on torch's meta device (no memory), its weight bytes
by part, its KV bytes a token, the transients the engine's plan reserves and the pages that fit
(``pegainfer_deepseek.sizing``). A computed plan, not a measurement: it prints a table (``--out``: into
that file as well) and writes no bench/results record. ``write_folder`` gives the weightless checkpoint
folder the eight-GPU serving benchmark starts from (``bench/serve.sh deepseek_v3_671b_tp8``).

    python bench/deepseek_671b_plan.py                      # tp=8, 64 x 4096-token requests, 8192-token steps
    python bench/deepseek_671b_plan.py --max-model-len 0 --max-num-seqs 128 --max-num-batched-tokens 4096
        # the engine's defaults: max_model_len from the config (163840)

The GPU's size is torch's total for an H200 (``torch.cuda.mem_get_info``: 143771 MiB) by default; the
budget is ``gpu_memory_utilization`` of it, with nothing else on the device (a real rank also loses its
CUDA context and NCCL buffers to the budget). The MTP layer (``model.layers.61``) is built only when
drafting (``--speculative-tokens``); its bytes are shown apart either way.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from pegainfer.config.schema import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from pegainfer.text.tiny_tokenizer import write_tiny_tokenizer
from pegainfer_deepseek.published import deepseek_v3_published_config
from pegainfer_deepseek.sizing import (
    build_on_meta,
    bytes_by_part,
    gpu_plan,
    kv_bytes_per_token,
    parameter_count,
)

#: An H200's memory as torch reports it (``torch.cuda.mem_get_info``'s total), in MiB.
H200_MIB = 143771
MIB, GIB, GB = 1 << 20, 1 << 30, 10**9


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(max_model_len=args.max_model_len or None),
        cache=CacheConfig(gpu_memory_utilization=args.gpu_memory_utilization),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens
        ),
        speculative=SpeculativeConfig(num_tokens=args.speculative_tokens),
    )


def row(name: str, n: int, note: str = "") -> str:
    return f"  {name:<30} {n / GIB:>9.2f} GiB {n / GB:>9.2f} GB  {note}".rstrip()


def plan_table(args: argparse.Namespace) -> str:
    engine = engine_config(args)
    config = deepseek_v3_published_config()
    tp, gpu_bytes = args.tp, args.gpu_mib * MIB
    model = build_on_meta(config, engine, 0, tp)
    whole = build_on_meta(config, engine, 0, 1)
    plan = gpu_plan(model, config, engine, gpu_bytes)
    parts, whole_parts = bytes_by_part(model), bytes_by_part(whole)
    params = parameter_count(whole)
    per_token = kv_bytes_per_token(model, engine)
    d = model.dims
    latent = (d.kv_lora_rank + d.qk_rope_head_dim) * model.dtype.itemsize
    sched = engine.scheduler
    tokens = plan.num_blocks * plan.block_size
    lines = [
        f"DeepSeek-V3 (published config: {len(model.layers)} layers, {d.n_routed_experts} experts, FP8 "
        f"{'x'.join(map(str, d.fp8_block))} blocks), "
        f"rank 0 of tp={tp}, {model.dtype}",
        f"weights per rank (tp=1 for comparison; MTP layer {'built' if model.mtp else 'not built'}):",
    ]
    for part, n in parts.items():
        lines.append(row(part, n, f"tp=1 {whole_parts[part] / GB:.2f} GB"))
    whole_bytes = sum(whole_parts.values())
    note = f"tp=1 {whole_bytes / GB:.2f} GB, /{tp} = {whole_bytes / tp / GB:.2f} GB; {params / 1e9:.2f}B parameters"
    lines.append(row("total", plan.weight_bytes, note))
    if not model.mtp:
        drafting = engine.model_copy(update={"speculative": SpeculativeConfig(num_tokens=1)})
        mtp_rank = bytes_by_part(build_on_meta(config, drafting, 0, tp))["MTP layer"]
        mtp_whole = bytes_by_part(build_on_meta(config, drafting, 0, 1))["MTP layer"]
        lines.append(row("MTP layer when drafting", mtp_rank, f"tp=1 {mtp_whole / GB:.2f} GB"))
    lines += [
        f"KV cache: {per_token} B a token per rank ({per_token // latent} latent caches of {d.kv_lora_rank} + "
        f"{d.qk_rope_head_dim} x {model.dtype.itemsize} B: the whole latent on every rank), "
        f"{plan.page_bytes / MIB:.2f} MiB a {plan.block_size}-token page",
        f"transients (max_num_seqs {sched.max_num_seqs}, max_num_batched_tokens "
        f"{sched.max_num_batched_tokens}, max_model_len {model.max_model_len}):",
        *(row(role, n) for role, n in plan.transients.items()),
        row("total", plan.transient_bytes),
        f"budget: {engine.cache.gpu_memory_utilization} x {args.gpu_mib} MiB = {plan.budget / MIB:.0f} MiB",
        row("weights", plan.weight_bytes),
        row("transients", plan.transient_bytes),
        row("KV pages", plan.kv_bytes),
        f"pages: {plan.num_blocks} x {plan.block_size} tokens = {tokens} tokens a rank "
        f"({tokens / model.max_model_len:.1f} requests of max_model_len; "
        f"{sched.max_num_seqs} x {model.max_model_len} tokens take "
        f"{sched.max_num_seqs * model.max_model_len * per_token / GIB:.2f} GiB)",
    ]
    return "\n".join(lines)


def write_folder() -> Path:
    """A checkpoint folder of the published config (FP8 blocks, the MTP layer) without weights, for
    ``pegainfer serve ... model.load_format=dummy tp=8`` (``bench/serve.sh deepseek_v3_671b_tp8``): its
    config.json and a word tokenizer with a word for every id, so streams carry one text chunk a token."""
    from common import write_word_tokenizer

    folder = Path(tempfile.mkdtemp(prefix="deepseek-671b-"))
    config = deepseek_v3_published_config()
    write_tiny_tokenizer(folder)
    write_word_tokenizer(folder, config["vocab_size"])
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-model-len", type=int, default=4096, help="0: the config's (163840)")
    parser.add_argument("--speculative-tokens", type=int, default=0, help="> 0: drafting (the MTP layer)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--gpu-mib", type=int, default=H200_MIB, help="the GPU's total memory in MiB")
    parser.add_argument("--out", type=Path, default=None, help="write the table into this file too")
    args = parser.parse_args()
    table = plan_table(args)
    print(table)
    if args.out is not None:
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
