"""Qwen3.5-MoE's expert selection from the router's logits: a Triton kernel and its torch reference.

From logits ``[T, E + 1]`` (a strided view of the router GEMM's output is fine; the last column is the
shared expert's gate logit): ``p = softmax(logits[:, :E])`` in fp32, the ``k`` largest ``p`` (ids best
first), renormalised to sum to 1 when ``norm``, cast to ``dtype``; then ``shared`` more columns, the shared
expert's pieces (``SparseMoE``: experts ``E .. E + shared - 1``), each weighted ``sigmoid(gate logit)`` in
``dtype``. The kernel is one program per token for all of it, where the torch form is some eight launches a
layer, paid in latency by a batch-1 decode step; it has no host sync, so it runs inside CUDA graphs. Ties
between equal probabilities go to the lower index (torch's ``topk`` leaves their order open).

``real_rows`` (a device int tensor ``[1]``, a prefill graph's count of real tokens): the rows from it on
are padding, and each takes row 0's selection and weights. With selections of their own, a graph step of a
few tokens (an MTP verification in a bucket a few rows wider) would have the fused MoE read up to ``k``
experts a padding row that no real row chose; taking row 0's adds rows to experts the step reads anyway.
"""

from __future__ import annotations

import torch

from pegainfer.kernels._triton import next_pow2, pdl_launch, pdl_start, tl, triton
from pegainfer.ops import use_triton


def softmax_topk_ref(
    logits: torch.Tensor,
    k: int,
    norm: bool,
    dtype: torch.dtype,
    shared: int,
    real_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    experts = logits.shape[1] - 1
    if real_rows is not None:
        rows = torch.arange(logits.shape[0], device=logits.device)
        logits = logits.index_select(0, torch.where(rows < real_rows, rows, 0))
    probs = torch.softmax(logits[:, :experts], dim=-1, dtype=torch.float32)
    weights, ids = probs.topk(k, dim=-1)
    if norm:
        weights = weights / weights.sum(-1, keepdim=True)
    gate = torch.sigmoid(logits[:, experts:].float()).to(dtype).expand(-1, shared)
    shared_ids = torch.arange(experts, experts + shared, device=logits.device).expand(len(logits), -1)
    return torch.cat([weights.to(dtype), gate], 1), torch.cat([ids, shared_ids], 1)


@triton.jit
def _softmax_topk_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    real_ptr,
    stride_l,
    NUM_EXPERTS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    K: tl.constexpr,
    SHARED: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NORM: tl.constexpr,
    HAS_REAL: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_start(PDL)
    token = tl.program_id(0).to(tl.int64)
    source = token  # the row whose logits select: a padding row takes row 0's
    if HAS_REAL:
        source = tl.where(token < tl.load(real_ptr), token, 0)
    row = logits_ptr + source * stride_l
    expert = tl.arange(0, BLOCK_E)
    valid = expert < NUM_EXPERTS
    logit = tl.load(row + expert, mask=valid, other=float("-inf")).to(tl.float32)
    # The K best probabilities are the K best logits (softmax keeps the order): each pick is one max over
    # int64 keys, the logit's bits made order-preserving as integers above BLOCK_E - 1 - expert (equal
    # logits: the lower index wins). Every reduction is a barrier across the warps, latency a batch-1
    # step pays, so one a pick: 3.2 -> 2.3 us a launch against a max and a min of the index a pick (H200).
    bits = tl.where(logit == 0.0, 0.0, logit).to(tl.int32, bitcast=True)  # -0 ties with +0
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    key = (ordered.to(tl.int64) << 32) | (BLOCK_E - 1 - expert).to(tl.int64)
    never = -9223372036854775807  # the key of padding and of picks: below every logit's
    key = tl.where(valid, key, never)
    slot = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    picked = tl.full([BLOCK_K], float("-inf"), tl.float32)
    for i in tl.static_range(K):
        top = tl.max(key, 0)
        pick = BLOCK_E - 1 - (top & 0xFFFFFFFF).to(tl.int32)
        high = (top >> 32).to(tl.int32)
        value = tl.where(high < 0, high ^ 0x7FFFFFFF, high).to(tl.float32, bitcast=True)
        ids = tl.where(slot == i, pick, ids)
        picked = tl.where(slot == i, value, picked)
        key = tl.where(expert == pick, never, key)
    # The probabilities of the picks only: exp(l - max) over the row's sum, or over the picks' sum.
    best = tl.max(picked, 0)
    e = tl.exp(picked - best)  # 0 past the K picks
    if NORM:
        weights = e / tl.sum(e, 0)
    else:
        weights = e / tl.sum(tl.exp(logit - best), 0)
    dtype = weights_ptr.dtype.element_ty
    # Slots K .. K + SHARED - 1: the shared expert's pieces, gated as one.
    gate = 1.0 / (1.0 + tl.exp(-tl.load(row + NUM_EXPERTS).to(tl.float32)))
    is_shared = (slot >= K) & (slot < K + SHARED)
    weights = tl.where(slot < K, weights.to(dtype), tl.where(is_shared, gate.to(dtype), 0.0).to(dtype))
    ids = tl.where(is_shared, NUM_EXPERTS + slot - K, ids)
    out = token * (K + SHARED) + slot
    tl.store(weights_ptr + out, weights, mask=slot < K + SHARED)
    tl.store(ids_ptr + out, ids.to(tl.int64), mask=slot < K + SHARED)


def softmax_topk_triton(
    logits: torch.Tensor,
    k: int,
    norm: bool,
    dtype: torch.dtype,
    shared: int,
    real_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, columns = logits.shape
    experts = columns - 1
    if logits.stride(-1) != 1 or not 0 < k <= experts:
        raise ValueError(
            f"softmax_topk: logits {tuple(logits.shape)} (E + 1 columns) need a contiguous last dim and k <= E"
        )
    weights = torch.empty(tokens, k + shared, dtype=dtype, device=logits.device)
    ids = torch.empty(tokens, k + shared, dtype=torch.int64, device=logits.device)
    if tokens:
        _softmax_topk_kernel[(tokens,)](
            logits, weights, ids, ids if real_rows is None else real_rows, logits.stride(0),
            NUM_EXPERTS=experts, BLOCK_E=next_pow2(experts), K=k, SHARED=shared,
            BLOCK_K=max(2, next_pow2(k + shared)), NORM=norm, HAS_REAL=real_rows is not None,
            num_warps=4 if experts > 64 else 1, **pdl_launch(logits),
        )  # fmt: skip
    return weights, ids


def softmax_topk(
    logits: torch.Tensor,
    k: int,
    norm: bool,
    dtype: torch.dtype,
    shared: int,
    real_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights ``[T, k + shared]`` in ``dtype``, ids ``[T, k + shared]`` int64) of the module docstring
    (``real_rows``: padding from there on takes row 0's): the kernel on CUDA (unless
    ``PEGAINFER_DISABLE_TRITON``), the torch reference elsewhere."""
    select = softmax_topk_triton if use_triton(logits) else softmax_topk_ref
    return select(logits, k, norm, dtype, shared, real_rows)
