"""DeepSeek-V3.2's lightning-indexer scores for decode rows, in one Triton launch over the paged key cache.

``indexer_decode_scores(q, weights, cache, block_tables, seq_lens, max_seq_len)`` returns ``index``
``[B, max_seq_len]`` (fp32): for row ``b`` and cached position ``s < seq_lens[b]``,

    index[b, s] = sum_h  weights[b, h] * ReLU(q[b, h] . k[s]),

``-inf`` past ``seq_lens[b]`` (a padding row, length 0, gets ``-inf`` everywhere). ``q`` ``[B, nI, dI]``
and ``weights`` ``[B, nI]`` (both scales folded in) are fp32, ``cache`` ``[blocks, block_size, dI]`` is
read through ``block_tables[b]``. The torch form (``LightningIndexer._decode_scores_ref``) gathers every
row's keys up to ``max_seq_len`` in fp32 and materialises the ``[B, nI, max_seq_len]`` scores; here one
program scores ``BLOCK_N`` positions of one row for all heads (a tensor-core dot, fp32 in three tf32
passes), so nothing but the ``[B, max_seq_len]`` result is written. The top-k stays ``torch.topk``.

Graph-safe: the grid comes from the batch and the static ``max_seq_len``; no host sync.
"""

from __future__ import annotations

import torch

from pegainfer.kernels._triton import dot_precision, mma, next_pow2, tl, triton

#: Cached positions a program scores.
BLOCK_N = 64


@triton.jit
def _indexer_decode_kernel(
    q_ptr,
    w_ptr,
    cache_ptr,
    tables_ptr,
    seq_lens_ptr,
    out_ptr,
    num_heads,
    head_dim,
    width,
    stride_qb,
    stride_qh,
    stride_wb,
    stride_cblk,
    stride_ctok,
    stride_bt,
    stride_ob,
    PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PREC: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    n0 = tl.program_id(1) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    seq_len = tl.load(seq_lens_ptr + row)
    valid = offs_n < seq_len
    index = tl.full([BLOCK_N], float("-inf"), tl.float32)
    if n0 < seq_len:
        heads = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        mask_h = heads < num_heads
        mask_d = offs_d < head_dim
        q = tl.load(
            q_ptr + row * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
            mask=mask_h[:, None] & mask_d[None, :],
            other=0.0,
        )
        block = tl.load(tables_ptr + row * stride_bt + offs_n // PAGE, mask=valid, other=0).to(tl.int64)
        tok = block * stride_cblk + (offs_n % PAGE) * stride_ctok
        keys = tl.load(
            cache_ptr + tok[:, None] + offs_d[None, :], mask=valid[:, None] & mask_d[None, :], other=0.0
        ).to(tl.float32)
        scores = mma(q, tl.trans(keys), False, PREC)  # [heads, positions]
        w = tl.load(w_ptr + row * stride_wb + heads, mask=mask_h, other=0.0)
        index = tl.where(valid, tl.sum(tl.maximum(scores, 0.0) * w[:, None], 0), float("-inf"))
    tl.store(out_ptr + row * stride_ob + offs_n, index, mask=offs_n < width)


def indexer_decode_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
) -> torch.Tensor:
    """See the module docstring."""
    batch, heads, dim = q.shape
    if q.dtype != torch.float32 or weights.dtype != torch.float32:
        raise ValueError(f"q and weights must be float32, got {q.dtype} and {weights.dtype}")
    if cache.dim() != 3 or cache.shape[-1] != dim or weights.shape != (batch, heads):
        raise ValueError(
            f"cache {tuple(cache.shape)} / weights {tuple(weights.shape)} do not fit q {tuple(q.shape)}"
        )
    for name, t in (("q", q), ("weights", weights), ("cache", cache), ("block_tables", block_tables)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dimension")
    width = max(1, max_seq_len)
    out = torch.empty(batch, width, dtype=torch.float32, device=q.device)
    if batch == 0:
        return out
    _indexer_decode_kernel[(batch, triton.cdiv(width, BLOCK_N))](
        q, weights, cache, block_tables, seq_lens, out, heads, dim, width,
        q.stride(0), q.stride(1), weights.stride(0), cache.stride(0), cache.stride(1), block_tables.stride(0),
        out.stride(0),
        PAGE=cache.shape[1], BLOCK_H=max(16, next_pow2(heads)), BLOCK_D=max(16, next_pow2(dim)), BLOCK_N=BLOCK_N,
        PREC=dot_precision(torch.float32), num_warps=4,
    )  # fmt: skip
    return out
