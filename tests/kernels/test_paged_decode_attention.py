"""Decode attention kernel vs the torch reference (``layers.attention.paged_attention_reference``).

Small shapes, run on CPU tensors through the Triton interpreter (or compiled, on a GPU). The cache is
NaN outside the written tokens and block tables are padded with a never-written page, so any read past
a row's length shows up as NaN. Tolerances (relative L2 error): fp32 against the fp32 reference 3e-5
(the GPU runs fp32 dots as tf32x3); bf16 against a float64 reference on the same bf16 inputs 5e-3
(the output's own rounding is ~1e-3) and no worse than twice the bf16 torch reference's own error.
"""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import DEVICE, PagedKV, rel_err

from pegainfer.kernels.paged_decode_attention import (
    decode_num_splits,
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_decode_attention_triton,
)

BLOCK = 16


def _case(seed, heads, kv_heads, head_dim, lens, dtype, *, strided_q=False):
    gen = torch.Generator().manual_seed(seed)
    kv = PagedKV(sum(-(-n // BLOCK) for n in lens) + 4, BLOCK, kv_heads, head_dim, dtype, DEVICE, gen)
    tables = kv.tables([kv.add(n) for n in lens], width=max(-(-n // BLOCK) for n in lens) + 2)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(lens), heads + (3 if strided_q else 0), head_dim, generator=gen).to(dtype).to(DEVICE)
    q = q[:, :heads] if strided_q else q
    return q, kv.cache, tables, seq_lens


def _truth(q, cache, tables, seq_lens, scale):
    clean = cache.nan_to_num(0.0).double()
    return paged_decode_attention_ref(q.double(), clean, tables, seq_lens, scale)


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim",
    [(4, 4, 64), (8, 2, 64), (16, 2, 128)],
    ids=["g1-d64", "g4-d64", "g8-d128"],
)
@pytest.mark.parametrize("num_splits", [1, 3, None], ids=["splits1", "splits3", "splits-auto"])
def test_decode_fp32_matches_reference(heads, kv_heads, head_dim, num_splits):
    lens = [1, 37, 0, 203, 16]  # one token, odd, padding row, many pages, exactly one page
    q, cache, tables, seq_lens = _case(1, heads, kv_heads, head_dim, lens, torch.float32, strided_q=True)
    scale = head_dim**-0.5
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=DEVICE)
    got = paged_decode_attention_triton(q, cache, tables, seq_lens, scale, out=out, num_splits=num_splits)
    assert got.data_ptr() == out.data_ptr()
    ref = paged_decode_attention_ref(q, cache.nan_to_num(0.0), tables, seq_lens, scale)
    assert rel_err(got, ref) < 3e-5
    assert torch.equal(got[2], torch.zeros_like(got[2])), "a padding row (seq_len 0) must give zeros"


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 1, 128), (8, 2, 64)], ids=["g8-d128", "g4-d64"])
def test_decode_bf16_close_to_float64(heads, kv_heads, head_dim):
    lens = [70, 5, 0, 129]
    q, cache, tables, seq_lens = _case(2, heads, kv_heads, head_dim, lens, torch.bfloat16)
    scale = head_dim**-0.5
    got = paged_decode_attention_triton(q, cache, tables, seq_lens, scale, num_splits=4)
    assert got.dtype == torch.bfloat16
    truth = _truth(q, cache, tables, seq_lens, scale)
    assert rel_err(got, truth) < 5e-3
    assert (
        rel_err(got, truth)
        <= 2 * rel_err(paged_decode_attention_ref(q, cache.nan_to_num(0.0), tables, seq_lens, scale), truth)
        + 1e-3
    )


def test_split_count_changes_nothing_but_rounding():
    """Splits (from 1 to more than a row has tiles) and a too-small ``max_seq_len`` hint (which only
    picks the split count) give the same result: lengths are read on the device, never from the hint."""
    lens = [300, 2, 77]
    q, cache, tables, seq_lens = _case(3, 8, 2, 64, lens, torch.float32)
    base = paged_decode_attention_triton(q, cache, tables, seq_lens, 0.125, num_splits=1)
    for kwargs in ({"num_splits": 2}, {"num_splits": 7}, {"num_splits": 64}, {"max_seq_len": 16}):
        other = paged_decode_attention_triton(q, cache, tables, seq_lens, 0.125, **kwargs)
        assert rel_err(other, base) < 1e-5, kwargs


def test_num_splits_heuristic_uses_static_sizes_only():
    assert decode_num_splits(1, 8, 1024) == 16  # 1024 / 64-token chunks
    assert decode_num_splits(1, 8, 40960) == 64  # 4 programs per SM of 132 is 66, capped at MAX_SPLITS
    assert decode_num_splits(128, 8, 40960) == 1
    assert 1 <= decode_num_splits(0, 8, 0) <= 64


def test_dispatch_takes_reference_off_cuda():
    q, cache, tables, seq_lens = _case(4, 4, 2, 64, [9, 20], torch.float32)
    cache = cache.nan_to_num(0.0).cpu()
    got = paged_decode_attention(q.cpu(), cache, tables.cpu(), seq_lens.cpu(), 0.125)
    assert torch.equal(got, paged_decode_attention_ref(q.cpu(), cache, tables.cpu(), seq_lens.cpu(), 0.125))
