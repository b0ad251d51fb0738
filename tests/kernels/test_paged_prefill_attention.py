"""Prefill / chunked-prefill attention kernel vs the torch reference (``paged_attention_reference``).

Several segments per launch: fresh prompts, chunks behind a cached prefix, one-token chunks, an empty
segment, lengths that are not multiples of the page or of the tiles; rows after the segments (decode
rows of a mixed batch) must stay untouched. The cache is NaN outside the written tokens. Tolerances
(relative L2 error): fp32 vs the fp32 reference 3e-5 (tf32x3 dots on the GPU); bf16 vs a float64
reference on the same inputs 5e-3 and no worse than twice the bf16 torch reference's own error.
"""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import DEVICE, PagedKV, rel_err

from pegainfer.kernels.paged_prefill_attention import (
    paged_prefill_attention,
    paged_prefill_attention_ref,
    paged_prefill_attention_triton,
    prefill_tensors,
)
from pegainfer.layers.attention import PrefillSegment

BLOCK = 16
# (q_len, ctx_len): fresh prompt, chunk behind a prefix, 1-token chunk, empty, page-aligned chunk+prefix
SEGMENTS = [(21, 21), (33, 70), (1, 17), (0, 5), (16, 48)]
DECODE_ROWS = 3


def _case(seed, heads, kv_heads, head_dim, dtype, segments=SEGMENTS):
    gen = torch.Generator().manual_seed(seed)
    kv = PagedKV(sum(-(-c // BLOCK) for _, c in segments) + 4, BLOCK, kv_heads, head_dim, dtype, DEVICE, gen)
    segs, start = [], 0
    for q_len, ctx in segments:
        segs.append(PrefillSegment(q_start=start, q_len=q_len, ctx_len=ctx, block_table=kv.add(ctx)))
        start += q_len
    q = torch.randn(start + DECODE_ROWS, heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    return q, kv.cache, prefill_tensors(segs, DEVICE), start


def _sentinel(q):
    return torch.full(q.shape, 7.0, dtype=q.dtype, device=q.device)


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim", [(2, 2, 64), (8, 2, 64), (8, 1, 128)], ids=["g1-d64", "g4-d64", "g8-d128"]
)
@pytest.mark.parametrize("tiles", [(16, 16), (32, 16), (None, None)], ids=["m16n16", "m32n16", "default"])
def test_prefill_fp32_matches_reference(heads, kv_heads, head_dim, tiles):
    q, cache, meta, n = _case(1, heads, kv_heads, head_dim, torch.float32)
    scale = head_dim**-0.5
    got = paged_prefill_attention_triton(
        q, cache, meta, scale, out=_sentinel(q), block_m=tiles[0], block_n=tiles[1]
    )
    ref = paged_prefill_attention_ref(q, cache.nan_to_num(0.0), meta, scale, out=_sentinel(q))
    assert rel_err(got[:n], ref[:n]) < 3e-5
    assert (got[n:] == 7.0).all(), "rows outside the segments must be left as they were"


@pytest.mark.parametrize("splits", [2, 3])
def test_prefill_keys_split_over_programs(splits):
    """Keys split into runs over programs (a short chunk over a long context on the GPU), merged: the
    reference's rows; runs without keys (short contexts) merge to nothing."""
    segments = [(21, 21), (9, 300), (1, 17), (0, 5), (16, 48)]
    q, cache, meta, n = _case(5, 8, 2, 64, torch.float32, segments=segments)
    got = paged_prefill_attention_triton(q[:n], cache, meta, 0.125, block_m=16, block_n=16, num_splits=splits)
    ref = paged_prefill_attention_ref(q[:n], cache.nan_to_num(0.0), meta, 0.125)
    assert rel_err(got, ref) < 3e-5


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 1, 128), (4, 4, 64)], ids=["g8-d128", "g1-d64"])
def test_prefill_bf16_close_to_float64(heads, kv_heads, head_dim):
    q, cache, meta, n = _case(2, heads, kv_heads, head_dim, torch.bfloat16)
    scale = head_dim**-0.5
    got = paged_prefill_attention_triton(q, cache, meta, scale, block_m=32, block_n=16)
    clean = cache.nan_to_num(0.0)
    truth = paged_prefill_attention_ref(q.double(), clean.double(), meta, scale)[:n]
    torch_bf16 = paged_prefill_attention_ref(q, clean, meta, scale)[:n]
    assert rel_err(got[:n], truth) < 5e-3
    assert rel_err(got[:n], truth) <= 2 * rel_err(torch_bf16, truth) + 1e-3


def test_prefill_strided_q_and_long_prefix():
    """q as a view of a packed qkv buffer; a chunk whose prefix spans many pages and several tiles."""
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, d = 4, 2, 64
    kv = PagedKV(24, BLOCK, kv_heads, d, torch.float32, DEVICE, gen)
    segs = [PrefillSegment(0, 40, 300, kv.add(300)), PrefillSegment(40, 9, 9, kv.add(9))]
    packed = torch.randn(49, (heads + 2 * kv_heads) * d, generator=gen).to(DEVICE)
    q = packed[:, : heads * d].view(49, heads, d)
    meta = prefill_tensors(segs, DEVICE)
    got = paged_prefill_attention_triton(q, kv.cache, meta, 0.125, block_m=16, block_n=32)
    ref = paged_prefill_attention_ref(q, kv.cache.nan_to_num(0.0), meta, 0.125)
    assert rel_err(got, ref) < 3e-5


def test_prefill_tensors_pack_segments():
    segs = [PrefillSegment(0, 3, 10, torch.tensor([5])), PrefillSegment(3, 2, 40, torch.tensor([1, 2, 9]))]
    meta = prefill_tensors(segs, "cpu")
    assert (
        meta.q_start.tolist() == [0, 3]
        and meta.q_len.tolist() == [3, 2]
        and meta.ctx_len.tolist() == [10, 40]
    )
    assert meta.block_tables.tolist() == [[5, 0, 0], [1, 2, 9]] and meta.max_q_len == 3
    assert meta.max_ctx_len == 40
    assert meta.block_tables.dtype == meta.q_len.dtype == torch.int32


def test_dispatch_takes_reference_off_cuda():
    q, cache, meta, _ = _case(4, 4, 2, 64, torch.float32, segments=[(5, 20), (7, 7)])
    cache = cache.nan_to_num(0.0).cpu()
    meta = prefill_tensors(
        [
            PrefillSegment(0, 5, 20, meta.block_tables[0, :2].cpu()),
            PrefillSegment(5, 7, 7, meta.block_tables[1, :1].cpu()),
        ],
        "cpu",
    )
    got = paged_prefill_attention(q.cpu(), cache, meta, 0.125, out=_sentinel(q.cpu()))
    assert torch.equal(got, paged_prefill_attention_ref(q.cpu(), cache, meta, 0.125, out=_sentinel(q.cpu())))
