"""What a Qwen3.5 prefill forward allocates on the GPU against what the memory plan reserved for it.

    python bench/qwen35_transients.py --shapes 9b,35b_a3b --layers 4 [--out bench/results/qwen35.jsonl]

For each bench shape (``qwen35.SHAPES``, cut to ``--layers`` layers: the temporaries of one layer do not
grow with depth), an engine on the GPU runs prefills of 1 x 1024, 1 x 4096, 4 x 1024 and 1 x 8192 tokens
(the first one again after them, so the process's one-time allocations, fla's autotuning and cuBLAS's
workspace, land in the first); each forward's device allocations beyond what existed before it are set
against ``transient_specs`` for that many tokens and segments (figures
``qwen35_<shape>.prefill_transients.<requests>x<tokens>.allocated_mb`` / ``.reserve_mb``), and each
layer part's own peak (the GDN mixer, the MoE block, attention) is printed per token beside its share of
the bound (``pass_buffers.kernel_scratch_parts``).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from pathlib import Path

import torch
from common import Results, build
from qwen35 import SHAPES, checkpoint_folder

from pegainfer.engine.request import Request
from pegainfer.executor.executor import ModelBatch, SequenceChunk
from pegainfer.sampling.sampling_params import SamplingParams
from pegainfer_qwen35 import pass_buffers

PREFILLS = [(1, 1024), (1, 4096), (4, 1024), (1, 8192), (1, 1024)]
PARTS = {"GatedDeltaNet": "gdn", "SparseMoE": "moe", "GatedAttention": "attention"}


def prefill(llm, prompts: list[list[int]]) -> None:
    """One prefill forward of ``prompts`` (each its own segment), its pages and slots freed after."""
    engine = llm.engine
    chunks, requests = [], []
    for i, prompt in enumerate(prompts):
        request = Request(f"r{i}", prompt, SamplingParams())
        assert engine.buffers.allocate_slots(request, len(prompt))
        requests.append(request)
        chunks.append(
            SequenceChunk(
                request.request_id, prompt, 0, engine.buffers.block_table(request.request_id),
                state_slot=engine.buffers.state_slot(request.request_id),
            )
        )  # fmt: skip
    try:
        engine.executor.execute(ModelBatch(chunks))
    finally:
        for request in requests:
            engine.buffers.free(request)


def measured(fn):
    """``fn`` wrapped to record the device bytes it allocates beyond those allocated when it starts."""
    peaks: list[int] = []

    def run(*args, **kwargs):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = fn(*args, **kwargs)
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - before)
        return out

    return run, peaks


def share(
    bound: dict[str, tuple[int, int]], part: str, tokens: int, segments: int, attention_fixed: int
) -> float:
    """A layer part's bound per token for this prefill: the GDN mixer's is its conv's or fla's, whichever
    is larger with the segments' share; attention's also holds the attention backend's fixed scratch."""
    names = ("gdn_conv", "gdn_fla") if part == "gdn" else (part,)
    per_step = max(bound[n][0] * tokens + bound[n][1] * segments for n in names if n in bound)
    return (per_step + (attention_fixed if part == "attention" else 0)) / tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="9b,35b_a3b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None, help="append the records to this JSONL file")
    parser.add_argument("--commit", default=None)
    args = parser.parse_args()
    results = Results(args.out or Path(os.devnull), "python " + " ".join(sys.argv), args.commit)
    rng = random.Random(0)
    for name in args.shapes.split(","):
        shape = {**SHAPES[name], "num_hidden_layers": args.layers}
        llm = build(
            checkpoint_folder(shape), max_num_seqs=8, max_model_len=8192 + 64, gpu_memory_utilization=0.5,
            max_num_batched_tokens=8192,
        )  # fmt: skip
        model = llm.engine.executor.runner.model
        model.forward, forward_peaks = measured(model.forward)
        part_peaks: dict[str, list[int]] = {}
        for module in model.modules():
            part = PARTS.get(type(module).__name__)
            if part is not None:
                module.forward, peaks = measured(module.forward)
                part_peaks.setdefault(part, []).append(peaks)  # type: ignore[arg-type]
        bound = pass_buffers.kernel_scratch_parts(model.config, model.dtype, model.shard)
        attention_fixed = sum(s.bytes_fixed for s in model.transient_specs() if s.role == "attention_scratch")
        print(f"qwen35_{name}: kernel path {model.kernel_path}")
        for i, (requests, length) in enumerate(PREFILLS):
            forward_peaks.clear()
            for lists in part_peaks.values():
                for peaks in lists:
                    peaks.clear()
            prefill(llm, [[rng.randrange(1000) for _ in range(length)] for _ in range(requests)])
            tokens = requests * length
            reserve = sum(spec.bytes_for(tokens, requests) for spec in model.transient_specs())
            key = f"qwen35_{name}.prefill_transients.{requests}x{length}" + (".cold" if i == 0 else "")
            results.add(f"{key}.allocated_mb", forward_peaks[0] / 2**20, "MiB")
            results.add(f"{key}.reserve_mb", reserve / 2**20, "MiB")
            parts = {
                part: max(max(peaks, default=0) for peaks in lists) / tokens
                for part, lists in part_peaks.items()
            }
            shares = {part: share(bound, part, tokens, requests, attention_fixed) for part in parts}
            print(
                f"  {requests}x{length}: forward {forward_peaks[0] / 2**20:.1f} MiB of {reserve / 2**20:.1f} "
                "reserved; per token (B), part's own peak / its bound: "
                + ", ".join(f"{part} {parts[part]:.0f} / {shares[part]:.0f}" for part in parts)
            )
        llm.engine.shutdown()
        del llm, model
        torch.cuda.empty_cache()
    if args.out:
        results.write()


if __name__ == "__main__":
    main()
