"""DeepSeek-V3's group-limited top-k selection ("noaux_tc") from the router's logits: a Triton kernel and
its torch reference.

From logits ``[T, E]`` (fp32): scores ``sigmoid(logits)``; the selection ranks the biased scores
``scores + bias``, keeps the ``topk_group`` groups (of ``E / n_group`` experts) whose two best biased
scores sum highest, and takes the ``k`` best experts inside them; the weights are the chosen experts'
*unbiased* scores, renormalised when ``norm`` and times ``scaling``. Returns (weights ``[T, k]`` fp32,
ids ``[T, k]`` int64), best first.

The kernel is one program per token for the whole selection (the torch form is some twenty small
launches a layer, which a batch-1 decode step pays in latency); no host sync, so it runs inside CUDA
graphs. Ties between equal scores go to the lower index (torch's ``topk`` leaves their order open).

``real_rows`` (a device int tensor ``[1]``, a prefill graph's count of real tokens): the rows from it on
are padding, and each takes row 0's selection. A padding row's hidden state is its own (a padding token
at position 0), and with its own selection it would have the fused MoE read experts no real row chose:
as many as ``k`` more a layer, in a graph step of a few tokens (an MTP verification) as much as the real
rows' own. Taking row 0's, it adds rows to experts the step reads anyway.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pegainfer.kernels._triton import next_pow2, tl, triton
from pegainfer.ops import use_triton


@dataclass(frozen=True)
class TopkRule:
    """The selection's sizes: ``n_group`` groups, ``topk_group`` of them kept, ``k`` experts chosen; the
    weights renormalised when ``norm``, then times ``scaling``."""

    n_group: int
    topk_group: int
    k: int
    norm: bool
    scaling: float


def group_limited_topk_ref(
    logits: torch.Tensor, bias: torch.Tensor, rule: TopkRule, real_rows: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    n_group, topk_group, k = rule.n_group, rule.topk_group, rule.k
    if real_rows is not None:
        rows = torch.arange(logits.shape[0], device=logits.device)
        logits = logits.index_select(0, torch.where(rows < real_rows, rows, 0))
    scores = logits.sigmoid()
    choice = scores + bias
    if n_group > 1:
        per_group = logits.shape[-1] // n_group
        grouped = choice.view(-1, n_group, per_group)
        group_scores = grouped.topk(min(2, per_group), dim=-1).values.sum(dim=-1)
        kept = group_scores.topk(topk_group, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        choice = choice.masked_fill(~keep.repeat_interleave(per_group, dim=1), float("-inf"))
    ids = choice.topk(k, dim=-1).indices
    weights = scores.gather(1, ids)
    if rule.norm:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * rule.scaling, ids


@triton.jit
def _group_limited_topk_kernel(
    logits_ptr,
    bias_ptr,
    weights_ptr,
    ids_ptr,
    real_ptr,
    stride_l,
    scaling,
    NUM_EXPERTS: tl.constexpr,
    GROUPS: tl.constexpr,
    PER_GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_PG: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NORM: tl.constexpr,
    HAS_REAL: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    source = token  # the row whose logits select: a padding row takes row 0's
    if HAS_REAL:
        source = tl.where(token < tl.load(real_ptr), token, 0)
    g = tl.arange(0, BLOCK_G)
    j = tl.arange(0, BLOCK_PG)
    valid = (g[:, None] < GROUPS) & (j[None, :] < PER_GROUP)
    # [groups, experts of a group]; the padding slots get an id no expert has (they would alias the next
    # group's experts otherwise).
    expert = tl.where(valid, g[:, None] * PER_GROUP + j[None, :], NUM_EXPERTS)
    logit = tl.load(logits_ptr + source * stride_l + expert, mask=valid, other=0.0)
    scores = tl.sigmoid(logit)
    bias = tl.load(bias_ptr + expert, mask=valid, other=0.0)
    choice = tl.where(valid, scores + bias, float("-inf"))
    if GROUPS > 1:
        best = tl.max(choice, 1)
        group_score = best
        if PER_GROUP > 1:  # plus the second best: the first best's slot (lowest index on a tie) left out
            first = tl.min(tl.where(choice == best[:, None], j[None, :], BLOCK_PG), 1)
            group_score += tl.max(tl.where(j[None, :] == first[:, None], float("-inf"), choice), 1)
        group_score = tl.where(g < GROUPS, group_score, float("-inf"))
        keep = g < 0
        for _ in tl.static_range(TOPK_GROUP):
            top = tl.max(group_score, 0)
            pick = tl.min(tl.where(group_score == top, g, BLOCK_G), 0)
            keep = keep | (g == pick)
            group_score = tl.where(g == pick, float("-inf"), group_score)
        choice = tl.where(keep[:, None], choice, float("-inf"))
    slot = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    weights = tl.zeros([BLOCK_K], dtype=tl.float32)
    for i in tl.static_range(K):
        top = tl.max(tl.max(choice, 1), 0)
        pick = tl.min(tl.min(tl.where(choice == top, expert, NUM_EXPERTS), 1), 0)
        ids = tl.where(slot == i, pick, ids)
        weights = tl.where(slot == i, tl.sum(tl.sum(tl.where(expert == pick, scores, 0.0), 1), 0), weights)
        choice = tl.where(expert == pick, float("-inf"), choice)
    if NORM:
        weights = weights / (tl.sum(weights, 0) + 1e-20)
    tl.store(weights_ptr + token * K + slot, weights * scaling, mask=slot < K)
    tl.store(ids_ptr + token * K + slot, ids.to(tl.int64), mask=slot < K)


def group_limited_topk_triton(
    logits: torch.Tensor, bias: torch.Tensor, rule: TopkRule, real_rows: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    n_group, topk_group, k = rule.n_group, rule.topk_group, rule.k
    tokens, experts = logits.shape
    if logits.dtype != torch.float32 or logits.stride(-1) != 1 or experts % n_group:
        raise ValueError(f"logits must be fp32 [T, E] with a contiguous last dim, E a multiple of {n_group}")
    weights = torch.empty(tokens, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(tokens, k, dtype=torch.int64, device=logits.device)
    if tokens:
        per_group = experts // n_group
        _group_limited_topk_kernel[(tokens,)](
            logits, bias.contiguous(), weights, ids, ids if real_rows is None else real_rows,
            logits.stride(0), float(rule.scaling),
            NUM_EXPERTS=experts, GROUPS=n_group, PER_GROUP=per_group, BLOCK_G=next_pow2(n_group),
            BLOCK_PG=next_pow2(per_group), TOPK_GROUP=topk_group, K=k, BLOCK_K=max(2, next_pow2(k)), NORM=rule.norm,
            HAS_REAL=real_rows is not None, num_warps=4 if experts > 64 else 1,
        )  # fmt: skip
    return weights, ids


def group_limited_topk(
    logits: torch.Tensor, bias: torch.Tensor, rule: TopkRule, real_rows: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, ids) of the module docstring (``real_rows``: padding from there on takes row 0's): the
    kernel on CUDA (unless ``PEGAINFER_DISABLE_TRITON``), the torch reference elsewhere."""
    select = group_limited_topk_triton if use_triton(logits) else group_limited_topk_ref
    return select(logits, bias, rule, real_rows)
