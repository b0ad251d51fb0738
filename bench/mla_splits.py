"""The MLA decode kernel's split count, side by side: the rule in ``mla_decode_num_splits`` against the
earlier one (about four programs per multiprocessor), at DeepSeek-V3's 128 heads and at 16 (a GPU's
share under tp=8), batch 1-64, each timed in a CUDA graph. Prints only: its figures are no records.

    python bench/mla_splits.py
"""

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import graph_time_ms  # noqa: E402

from pegainfer.kernels._triton import num_sms  # noqa: E402
from pegainfer_deepseek.mla_decode import (  # noqa: E402
    BLOCK_H,
    MAX_SPLITS,
    MIN_TOKENS_PER_SPLIT,
    mla_decode_attention_triton,
    mla_decode_num_splits,
)

RKV, DR, PAGE = 512, 64, 64
#: (batch, tokens of context, the static max_seq_len the graph is built for)
CASES = [(1, 512, 700), (1, 4096, 8192), (4, 2048, 8192), (16, 1024, 4096), (32, 512, 1024), (64, 4096, 8192)]


def four_per_sm(batch: int, heads: int, max_seq_len: int) -> int:
    programs = batch * math.ceil(heads / BLOCK_H)
    wanted = math.ceil(4 * num_sms(torch.device("cuda")) / programs)
    return max(1, min(wanted, math.ceil(max_seq_len / MIN_TOKENS_PER_SPLIT), MAX_SPLITS))


def compare(heads: int, batch: int, ctx: int, max_len: int) -> str:
    pages = batch * max_len // PAGE
    cache = torch.randn(pages, PAGE, RKV + DR, device="cuda", dtype=torch.bfloat16)
    tables = torch.randperm(pages, device="cuda").view(batch, -1).to(torch.int32)
    lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    q = torch.randn(batch, heads, RKV, device="cuda", dtype=torch.bfloat16) * 0.1
    q_pe = torch.randn(batch, heads, DR, device="cuda", dtype=torch.bfloat16) * 0.1

    def us(splits: int) -> float:
        def attend():
            return mla_decode_attention_triton(
                q, q_pe, cache, tables, lens, 0.1, max_seq_len=max_len, num_splits=splits
            )

        return graph_time_ms(attend) * 1e3

    old, new = four_per_sm(batch, heads, max_len), mla_decode_num_splits(batch, heads, max_len, q.device)
    return (
        f"MLA {heads} heads, batch {batch} x {ctx} (max {max_len}): four a SM {old} splits {us(old):.1f} us, "
        f"the wave rule {new} splits {us(new):.1f} us"
    )


for heads in (128, 16):
    for case in CASES:
        print(compare(heads, *case), flush=True)
