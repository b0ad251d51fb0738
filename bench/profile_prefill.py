"""Where a prefill step's time goes, with and without a prefix-cache hit: each engine step's wall time, the
host time to issue its forward and the forward's span on the GPU (a step whose issue time is near its span
is bound by the host), then (``--profile``) a torch.profiler table (host and GPU time by op) of a hit's
steps.

    python bench/profile_prefill.py --shape qwen35_9b [--prompt-len 2112 --shared-len 2048]

A step replayed from a prefill CUDA graph shows no forward call (its issue and GPU figures are 0) and
one graph launch in the profile: ``--override prefill_graph_max_tokens=0`` runs those steps eagerly, with
the same kernels, for their breakdown.
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from prefix_cache import gpu_shapes, random_tokens

from pegainfer.config.compose import build_engine_config, compose
from pegainfer.engine.llm import LLM
from pegainfer.sampling.sampling_params import SamplingParams


class ForwardTimes:
    """Wraps the model's forward: host ms to issue it, and its span on the GPU (CUDA events), per call."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.calls: list[tuple[float, torch.cuda.Event, torch.cuda.Event]] = []
        inner = model.forward

        def timed(*args, **kwargs):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            begin.record()
            out = inner(*args, **kwargs)
            end.record()
            self.calls.append(((time.perf_counter() - t0) * 1e3, begin, end))
            return out

        model.forward = timed

    def take(self) -> tuple[float, float]:
        """(issue ms, GPU ms) of the calls since the last take, summed (after a synchronize)."""
        calls, self.calls = self.calls, []
        return sum(c[0] for c in calls), sum(b.elapsed_time(e) for _, b, e in calls)


def run(llm: LLM, prompt: list[int], salt: str | None, times: ForwardTimes) -> list[str]:
    """``wall/issue/gpu`` ms of each step until ``prompt``'s first token."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    engine.add_request(f"p{time.perf_counter_ns()}", None, params, prompt_token_ids=prompt, cache_salt=salt)
    steps = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3
        steps.append("{:.1f}/{:.1f}/{:.1f}".format(wall, *times.take()))
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen35_9b")
    parser.add_argument("--prompt-len", type=int, default=2112)
    parser.add_argument("--shared-len", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=30)
    parser.add_argument("--profile", action="store_true", help="also the torch.profiler tables")
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        help="more Hydra overrides, e.g. prefill_graph_max_tokens=0",
    )
    args = parser.parse_args()
    [(name, folder)] = gpu_shapes(args.shape)
    overrides = [
        f"model.path={folder}", "device=cuda", "model.dtype=bfloat16", "model.load_format=dummy",
        f"model.max_model_len={args.prompt_len + 16}", *args.override,
    ]  # fmt: skip
    llm = LLM.from_config(build_engine_config(compose("generate", overrides)))
    times = ForwardTimes(llm.engine.executor.runner.model)
    rng = random.Random(0)
    prompt = random_tokens(rng, args.prompt_len)
    shared = [prompt[: args.shared_len] + random_tokens(rng, 64) for _ in range(4)]
    run(llm, prompt, None, times)  # cached from here on
    for rep in range(3):  # the first compiles (and autotunes) what a new shape needs
        print(
            f"[{name} rep {rep}] wall/issue/gpu ms of each step (miss: a fresh salt; hit: the prompt again;"
        )
        print(f"  shared: {args.shared_len} cached + 64 new)")
        for label, p, salt in [
            ("miss", prompt, f"m{rep}"),
            ("hit", prompt, None),
            ("shared", shared[rep], None),
        ]:
            print(f"  {label:6s}", " ".join(f"{step:>16s}" for step in run(llm, p, salt, times)))
    if not args.profile:
        return
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        run(llm, shared[3], None, times)
    events = prof.key_averages()
    for key in ("self_cpu_time_total", "device_time_total"):
        print(f"--- by {key}")
        for e in sorted(events, key=lambda e: getattr(e, key), reverse=True)[: args.rows]:
            print(
                f"{e.key[:70]:70s} self cpu {e.self_cpu_time_total / 1e3:8.2f} ms  gpu {e.device_time_total / 1e3:8.2f} ms  x{e.count}"
            )


if __name__ == "__main__":
    main()
