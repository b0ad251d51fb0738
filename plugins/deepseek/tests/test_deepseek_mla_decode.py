"""The MLA decode kernel (``mla_decode``) against its torch reference on fresh random inputs: several
rows of different lengths and a padding row, heads spread over two head blocks, one split and several,
dense rows and sparse ones (V3.2's indexer selection: a row longer than its K listed positions reads only
those).

Without a GPU the kernel runs through Triton's interpreter on CPU tensors (the conftest selects it) at
small shapes; with one the same cases run compiled, and the ``gpu``-marked one at DeepSeek-V3's shape
(128 heads, latent 512 + rope 64) inside a CUDA graph.
"""

from __future__ import annotations

import os

import pytest
import torch

from pegainfer_deepseek import mla_decode
from pegainfer_deepseek.mla_decode import (
    mla_decode_attention,
    mla_decode_attention_ref,
    mla_decode_attention_triton,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs a GPU or Triton's interpreter (TRITON_INTERPRET=1 before Triton)",
)


def _case(seq_lens, heads, rkv, dr, page, dtype, seed, topk=None):
    """Random operands; with ``topk``, indices ``[B, topk]``: distinct random positions for rows longer
    than ``topk``, a shuffled ``range(topk)`` for a row of exactly ``topk`` tokens, and out-of-range
    values for shorter rows (which must ignore them)."""
    gen = torch.Generator().manual_seed(seed)
    batch, width = len(seq_lens), -(-max(seq_lens) // page) + 1
    blocks = batch * width + 3

    def rand(*shape, std=1.0):
        return (torch.randn(*shape, generator=gen) * std).to(DEVICE, dtype)

    cache = rand(blocks, page, rkv + dr)
    # Each row's pages in a shuffled order, so the kernel must follow the block table.
    tables = torch.randperm(blocks, generator=gen)[: batch * width].view(batch, width).to(DEVICE, torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    indices = None
    if topk is not None:
        rows = [
            torch.randperm(n, generator=gen)[:topk] if n >= topk else torch.full((topk,), 10**6 + n)
            for n in seq_lens
        ]
        indices = torch.stack(rows).to(DEVICE, torch.int32)
    return rand(batch, heads, rkv, std=0.3), rand(batch, heads, dr, std=0.3), cache, tables, lens, indices


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("topk", [None, 20], ids=["dense", "sparse"])
@pytest.mark.parametrize("block_h, block_v", [(16, None), (32, 16)], ids=["h16", "h32-v16"])
@pytest.mark.parametrize("page", [4, 32], ids=["key-by-key", "in-page"])
def test_decode_matches_reference(dtype, num_splits, topk, block_h, block_v, page):
    """Heads over two head blocks (20 heads, 16 a block) or one partial one (32), the output features in
    one program or split over two (``block_v`` 16 of 32); 16-key tiles over 4-token pages (each key
    looks its page up) or inside one 32-token page. Sparse: 20 positions a row, so the rows of 77 and 33
    tokens gather (over two tiles, the second partial), the row of 20 reads all of its own through its
    indices and the row of 5 reads its tokens in order."""
    seq_lens = [5, 77, 0, 33, 20]  # several 16-key tiles, a partial last one
    q, q_pe, cache, tables, lens, indices = _case(
        seq_lens, 20, 32, 8, page, dtype, seed=num_splits, topk=topk
    )
    scale = 0.17
    ours = mla_decode_attention_triton(
        q, q_pe, cache, tables, lens, scale, max_seq_len=max(seq_lens), indices=indices,
        num_splits=num_splits, block_h=block_h, block_v=block_v, block_n=16,
    )  # fmt: skip
    ref = mla_decode_attention_ref(
        q, q_pe, cache, tables, lens, scale, max_seq_len=max(seq_lens), indices=indices
    )
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(ours.float(), ref.float(), **tol)
    assert not ours[2].any(), "the padding row (seq_len 0) must get zeros"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("block_v", [None, 32], ids=["both-halves", "a-half-a-program"])
@pytest.mark.parametrize("block_n", [16, 32])
def test_tma_tiles_match_reference_and_ignore_what_lies_past_a_row(dtype, num_splits, block_v, block_n):
    """The TMA form: heads over two 16-head blocks, the latent in two 32-wide halves (accumulated by one
    program or by two, ``block_v``), the absorbed queries transposed as the model makes them; NaN in every
    cached position past a row's length (the tail tiles' TMA boxes read them) leaves the output as the
    reference has it on the clean cache. 32-key tiles leave tails of one and two 16-key tail tiles."""
    seq_lens = [5, 77, 0, 59, 64]  # a tail alone, whole tiles and a tail, padding, whole tiles only
    q, q_pe, cache, tables, lens, _ = _case(seq_lens, 32, 64, 16, 32, dtype, seed=7 + num_splits)
    q = q.transpose(0, 1).contiguous().transpose(0, 1)  # [B, H, rkv] over [H, B, rkv] memory
    ref = mla_decode_attention_ref(q, q_pe, cache, tables, lens, 0.17, max_seq_len=77)
    page = cache.shape[1]
    for b, n in enumerate(seq_lens):
        past = torch.arange(n, tables.shape[1] * page, device=DEVICE)
        cache.view(-1, cache.shape[-1])[tables[b, past // page].long() * page + past % page] = float("nan")
    ours = mla_decode_attention_triton(
        q, q_pe, cache, tables, lens, 0.17, max_seq_len=77, num_splits=num_splits, block_h=16,
        block_n=block_n, block_v=block_v, tma=True,
    )  # fmt: skip
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(ours.float(), ref.float(), **tol)
    assert not ours[2].any(), "the padding row (seq_len 0) must get zeros"


def test_tma_tiles_refuse_what_they_cannot_load():
    q, q_pe, cache, tables, lens, indices = _case([30, 9], 32, 64, 16, 32, torch.float32, seed=2, topk=8)
    for bad in (
        dict(indices=indices),  # gathered rows
        dict(block_h=24),  # heads not a multiple of block_h
        dict(block_n=64),  # a tile over two pages
        dict(block_v=16),  # a quarter of the latent a program
    ):
        with pytest.raises(ValueError, match="tma needs"):
            mla_decode_attention_triton(q, q_pe, cache, tables, lens, 0.2, max_seq_len=30, tma=True, **bad)


def test_sparse_rows_read_only_their_listed_latents():
    """NaN in every latent a sparse row does not list (and past every row's length) leaves its output
    as it was on the clean cache: the kernel reads the listed positions only."""
    seq_lens, topk = [90, 7, 40], 16
    q, q_pe, cache, tables, lens, indices = _case(seq_lens, 4, 16, 8, 4, torch.float32, seed=5, topk=topk)
    ref = mla_decode_attention_ref(q, q_pe, cache, tables, lens, 0.2, max_seq_len=90, indices=indices)
    page = cache.shape[1]
    for b, n in enumerate(seq_lens):
        keep = indices[b].long() if n > topk else torch.arange(n, device=DEVICE)
        unread = torch.ones(tables.shape[1] * page, dtype=torch.bool, device=DEVICE)
        unread[keep] = False
        positions = unread.nonzero().squeeze(1)
        cache.view(-1, cache.shape[-1])[tables[b, positions // page].long() * page + positions % page] = (
            float("nan")
        )
    for splits in (1, 3):
        ours = mla_decode_attention_triton(
            q, q_pe, cache, tables, lens, 0.2, max_seq_len=90, indices=indices, num_splits=splits, block_n=16
        )
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


def test_indices_must_be_int32_rows_of_the_batch():
    q, q_pe, cache, tables, lens, indices = _case([30, 9], 4, 16, 8, 4, torch.float32, seed=2, topk=8)
    for bad in (indices.long(), indices[:1]):
        with pytest.raises(ValueError, match="indices"):
            mla_decode_attention_triton(q, q_pe, cache, tables, lens, 0.2, max_seq_len=30, indices=bad)


def test_key_tiles_below_the_tensor_core_minimum_are_refused():
    q, q_pe, cache, tables, lens, _ = _case([9], 4, 16, 8, 4, torch.float32, seed=2)
    with pytest.raises(ValueError, match="block_n"):
        mla_decode_attention_triton(q, q_pe, cache, tables, lens, 0.2, max_seq_len=9, block_n=8)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
def test_deepseek_v3_shape_inside_a_cuda_graph():
    """128 heads, latent 512 + rope 64, 64-token pages, rows up to 4096 tokens, replayed from a graph after
    the lengths changed (the grid comes from the static maximum only)."""
    seq_lens = [4096, 1, 777, 2049] * 4
    q, q_pe, cache, tables, lens, _ = _case(seq_lens, 128, 512, 64, 64, torch.bfloat16, seed=11)
    scale = 0.1
    # Other tilings of the benchmark (bench/deepseek.py MLA_TILINGS): 64 heads a program, all or half of
    # the output features, and the TMA form with both halves or one a program (one or two warpgroups).
    for block_h, block_v, block_n, warps, stages, tma in [
        (64, None, 32, 8, 2, False), (64, 256, 32, 8, 2, False), (64, None, 32, 8, 2, True),
        (64, 256, 16, 4, 2, True), (128, 256, 32, 8, 2, True),
    ]:  # fmt: skip
        ours = mla_decode_attention_triton(
            q, q_pe, cache, tables, lens, scale, max_seq_len=4096, block_h=block_h, block_v=block_v,
            block_n=block_n, num_warps=warps, num_stages=stages, tma=tma,
        )  # fmt: skip
        ref = mla_decode_attention_ref(q, q_pe, cache, tables, lens, scale, max_seq_len=4096)
        torch.testing.assert_close(ours.float(), ref.float(), atol=2e-2, rtol=2e-2)
    run = lambda: mla_decode_attention(q, q_pe, cache, tables, lens, scale, max_seq_len=4096)  # noqa: E731
    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    lens.copy_(torch.tensor([33, 4000, 1, 129] * 4, dtype=torch.int32))
    graph.replay()
    ref = mla_decode_attention_ref(q, q_pe, cache, tables, lens, scale, max_seq_len=4096)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
def test_v32_sparse_rows_inside_a_cuda_graph():
    """V3.2's shape: 2048 listed positions a row (all below 2049, so they stay inside every row that
    gathers), rows shorter, as long and longer, replayed from a graph after the lengths changed."""
    seq_lens, topk = [4096, 1, 3000, 2049] * 4, 2048
    q, q_pe, cache, tables, lens, _ = _case(seq_lens, 128, 512, 64, 64, torch.bfloat16, seed=12)
    gen = torch.Generator().manual_seed(13)
    indices = torch.stack([torch.randperm(2049, generator=gen)[:topk] for _ in seq_lens])
    indices = indices.to(DEVICE, torch.int32)
    scale = 0.1

    def run():
        return mla_decode_attention(q, q_pe, cache, tables, lens, scale, max_seq_len=4096, indices=indices)

    ref = lambda: mla_decode_attention_ref(  # noqa: E731
        q, q_pe, cache, tables, lens, scale, max_seq_len=4096, indices=indices
    )
    torch.testing.assert_close(run().float(), ref().float(), atol=2e-2, rtol=2e-2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    lens.copy_(torch.tensor([33, 4000, 2048, 2500] * 4, dtype=torch.int32))
    graph.replay()
    torch.testing.assert_close(out.float(), ref().float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(
    "heads, batch, max_seq_len, splits",
    [(16, 64, 8192, 4), (128, 16, 4096, 2), (128, 64, 8192, 1), (16, 1, 8192, 32), (128, 1, 700, 6)],
    ids=[
        "one-full-wave",
        "two-programs-a-sm",
        "no-split-needed",
        "never-fills:-the-most",
        "capped-by-length",
    ],
)
def test_splits_fill_the_last_wave(monkeypatch, heads, batch, max_seq_len, splits):
    """The fewest splits whose programs fill 90% of their last wave on 132 SMs."""
    monkeypatch.setattr(mla_decode, "num_sms", lambda device: 132)
    assert mla_decode.mla_decode_num_splits(batch, heads, max_seq_len, torch.device("cpu")) == splits


def test_dispatch_takes_the_tma_tiling_only_where_it_applies(monkeypatch):
    """Dense rows of 64k heads over 64k-token pages on Hopper with 2^23 head-tokens or more take
    ``TMA_TILING``; sparse rows, 16 heads (a tp=8 share), 16-token pages, less work, an older GPU and
    the CPU keep the kernel's defaults."""
    cuda = torch.device("cuda", 0)
    tiling = mla_decode.mla_decode_tiling
    monkeypatch.setattr(mla_decode, "_TMA", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert tiling(128, 64, 4096, 512, 64, 64, False, cuda) == mla_decode.TMA_TILING
    assert tiling(64, 32, 4096, 512, 64, 128, False, cuda) == mla_decode.TMA_TILING
    for heads, rows, page, sparse in ((128, 64, 64, True), (16, 64, 64, False), (128, 64, 16, False),
                                      (128, 16, 64, False), (64, 64, 64, False)):  # fmt: skip
        assert tiling(heads, rows, 1024, 512, 64, page, sparse, cuda) == {}
    assert tiling(128, 64, 4096, 512, 64, 64, False, torch.device("cpu")) == {}
    monkeypatch.setattr(mla_decode, "_TMA", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert tiling(128, 64, 4096, 512, 64, 64, False, cuda) == {}
