"""The group-limited top-k kernel (``routing``) against its torch reference on fresh random logits:
DeepSeek-V3's 256 experts in 8 groups, one group (Moonlight's 64 experts, top-6), groups whose size is
not a power of two, unnormalised weights, and a bias large enough to change the choice.

Without a GPU the kernel runs through Triton's interpreter on CPU tensors (the conftest selects it).
"""

from __future__ import annotations

import os

import pytest
import torch

from pegainfer_deepseek.routing import TopkRule, group_limited_topk_ref, group_limited_topk_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs a GPU or Triton's interpreter (TRITON_INTERPRET=1 before Triton)",
)


@pytest.mark.parametrize(
    "tokens, experts, n_group, topk_group, k, norm",
    [
        (5, 256, 8, 4, 8, True),
        (3, 64, 1, 1, 6, True),
        (4, 20, 4, 2, 3, False),
        (2, 12, 6, 3, 4, True),
        (1, 16, 16, 5, 5, True),
    ],
    ids=["v3", "one-group", "groups-of-5", "groups-of-2", "groups-of-1"],
)
def test_kernel_selects_and_weighs_as_the_reference(tokens, experts, n_group, topk_group, k, norm):
    gen = torch.Generator().manual_seed(experts + k)
    logits = (torch.randn(tokens, experts, generator=gen) * 2).to(DEVICE)
    bias = (torch.randn(experts, generator=gen) * 0.5).to(DEVICE)  # moves the choice, not the weights
    rule = TopkRule(n_group, topk_group, k, norm, 2.5)
    weights, ids = group_limited_topk_triton(logits, bias, rule)
    ref_weights, ref_ids = group_limited_topk_ref(logits, bias, rule)
    assert torch.equal(ids, ref_ids)  # best first, as topk orders them
    torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=1e-5)
    if n_group > 1:
        per_group = experts // n_group
        assert all(len(set(row.tolist())) <= topk_group for row in ids // per_group)


def test_kernel_refuses_logits_it_cannot_read():
    logits = torch.randn(2, 10, dtype=torch.float64, device=DEVICE)
    with pytest.raises(ValueError, match="fp32"):
        group_limited_topk_triton(logits, torch.zeros(10, device=DEVICE), TopkRule(2, 1, 2, True, 1.0))


@pytest.mark.parametrize("select", [group_limited_topk_triton, group_limited_topk_ref], ids=["kernel", "ref"])
def test_padding_rows_take_row_zeros_selection(select):
    """``real_rows``: the rows before it select as without it, every later row (a prefill graph's padding)
    takes row 0's experts and weights, so the fused MoE reads no expert for it that row 0 does not."""
    gen = torch.Generator().manual_seed(7)
    logits = (torch.randn(6, 256, generator=gen) * 2).to(DEVICE)
    bias = (torch.randn(256, generator=gen) * 0.5).to(DEVICE)
    rule = TopkRule(8, 4, 8, True, 2.5)
    free_weights, free_ids = group_limited_topk_ref(logits, bias, rule)
    weights, ids = select(logits, bias, rule, torch.tensor([4], device=DEVICE))
    assert torch.equal(ids[:4], free_ids[:4]) and torch.equal(ids[4:], free_ids[:1].expand(2, -1))
    torch.testing.assert_close(weights[:4], free_weights[:4], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(weights[4:], free_weights[:1].expand(2, -1), atol=1e-6, rtol=1e-5)
    assert not torch.equal(free_ids[4:], free_ids[:1].expand(2, -1))  # the rows had choices of their own
