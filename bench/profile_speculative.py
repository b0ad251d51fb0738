"""Where a Qwen3.5 9B-style drafting step (batch 1, k = 1 and 2, random weights) spends its wall time:
the verification forward, the MTP pass (``propose``), the whole engine step; synchronised timers around
each, so the GPU work of a phase counts in it. Prints only: its figures are no records.

    python bench/profile_speculative.py
"""

import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import qwen35  # noqa: E402
from common import build, greedy  # noqa: E402

shape = dict(qwen35.SHAPES["9b"], mtp_num_hidden_layers=1)
folder = qwen35.checkpoint_folder(shape)
prompt = list(range(100, 612))


def profile(k: int) -> None:
    """Print the phases of ``k``-draft steps; a function, so nothing outlives the engine's shutdown."""
    llm = build(folder, max_num_seqs=1, max_model_len=1024, speculative_tokens=k)
    engine = llm.engine
    runner = engine.executor.runner
    spent: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)

    def timed(name, fn):
        def wrapper(*a, **kw):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            torch.cuda.synchronize()
            spent[name] += time.perf_counter() - t0
            counts[name] += 1
            return out

        return wrapper

    runner._execute_prefill_graph = timed("verify (prefill graph)", runner._execute_prefill_graph)
    runner._execute_eager = timed("eager forward", runner._execute_eager)
    runner._execute_graph = timed("decode graph", runner._execute_graph)
    engine.executor.propose = timed("propose (MTP)", engine.executor.propose)
    engine.step = timed("engine.step", engine.step)
    llm.generate(prompt_token_ids=[prompt], sampling_params=greedy(8), use_tqdm=False)
    spent.clear()
    counts.clear()
    llm.generate(prompt_token_ids=[prompt], sampling_params=greedy(65), use_tqdm=False)
    for name in spent:
        print(f"k={k} {name:<24} {counts[name]:4d} calls {spent[name] / counts[name] * 1e3:7.3f} ms each")
    engine.shutdown()


for k in (1, 2):
    profile(k)
