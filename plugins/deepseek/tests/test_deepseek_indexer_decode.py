"""V3.2's indexer decode scores (``indexer_decode``) against the torch form on fresh random inputs: rows
of different lengths over shuffled pages, a padding row, head and key widths no tile divides; the top-k
selections they lead to are equal.

Without a GPU the kernel runs through Triton's interpreter on CPU tensors (the conftest selects it); with
one, compiled, and the ``gpu``-marked case at V3.2's indexer shape (64 heads x 128) inside a CUDA graph.
"""

from __future__ import annotations

import os

import pytest
import torch

from pegainfer_deepseek.indexer import LightningIndexer, top_k_mask
from pegainfer_deepseek.indexer_decode import indexer_decode_scores

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs a GPU or Triton's interpreter (TRITON_INTERPRET=1 before Triton)",
)

reference = LightningIndexer._decode_scores_ref


def _case(seq_lens, heads, dim, page, max_seq_len, cache_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    batch, width = len(seq_lens), -(-max_seq_len // page)
    blocks = batch * width + 2
    # Pages no row owns hold NaN: a valid position read through the wrong page would show it.
    cache = torch.full((blocks, page, dim), float("nan"))
    cache[: blocks - 2] = torch.randn(blocks - 2, page, dim, generator=gen)
    order = torch.randperm(blocks - 2, generator=gen)[: batch * width].view(batch, width)
    for b, n in enumerate(seq_lens):  # a row's pages past its length: the poisoned ones
        order[b, -(-n // page) :] = blocks - 1 - b % 2
    q = torch.randn(batch, heads, dim, generator=gen) * dim**-0.5
    weights = torch.randn(batch, heads, generator=gen).abs()
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return [t.to(DEVICE) for t in (q, weights, cache.to(cache_dtype), order.to(torch.int32), lens)]


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_scores_and_selection_equal_the_torch_form(cache_dtype):
    seq_lens, max_seq_len, topk = [37, 0, 130, 1], 140, 20
    q, weights, cache, tables, lens = _case(seq_lens, 5, 24, 16, max_seq_len, cache_dtype, seed=3)
    ours = indexer_decode_scores(q, weights, cache, tables, lens, max_seq_len)
    ref = reference(q, weights, cache, tables, lens, max_seq_len)
    assert ours.shape == (len(seq_lens), max_seq_len)
    for b, n in enumerate(seq_lens):
        assert torch.isneginf(ours[b, n:]).all()  # past the row's length, and a padding row throughout
        torch.testing.assert_close(ours[b, :n], ref[b, :n], atol=1e-5, rtol=1e-5)
    valid = torch.arange(max_seq_len, device=DEVICE)[None, :] < lens[:, None]
    assert torch.equal(top_k_mask(ours, valid, topk), top_k_mask(ref, valid, topk))


def test_refuses_16_bit_queries():
    q, weights, cache, tables, lens = _case([8], 4, 16, 16, 16, torch.float32, seed=1)
    with pytest.raises(ValueError, match="float32"):
        indexer_decode_scores(q.bfloat16(), weights, cache, tables, lens, 16)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
def test_v32_indexer_shape_inside_a_cuda_graph():
    """64 heads x 128, pages of 64, four rows up to 2048 positions, replayed after the lengths changed."""
    max_seq_len = 2048
    q, weights, cache, tables, lens = _case(
        [max_seq_len] * 4, 64, 128, 64, max_seq_len, torch.bfloat16, seed=5
    )
    lens.copy_(torch.tensor([2048, 700, 1, 1500], dtype=torch.int32))
    indexer_decode_scores(q, weights, cache, tables, lens, max_seq_len)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = indexer_decode_scores(q, weights, cache, tables, lens, max_seq_len)
    lens.copy_(torch.tensor([1000, 2048, 64, 3], dtype=torch.int32))
    graph.replay()
    ref = reference(q, weights, cache, tables, lens, max_seq_len)
    valid = torch.arange(max_seq_len, device=DEVICE)[None, :] < lens[:, None]
    torch.testing.assert_close(out[valid], ref[valid], atol=1e-4, rtol=1e-4)
    assert torch.isneginf(out[~valid]).all()
