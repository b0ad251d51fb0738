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
