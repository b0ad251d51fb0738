"""The MoE expert selection kernel (``routing.softmax_topk``) against its torch reference on fresh random
logits: strided rows (the router GEMM's output holds the shared gate's logit last, and the rows may be a
view of a wider buffer), a non-power-of-two expert count, with and without renormalisation, one shared
piece or several. Without a GPU through Triton's interpreter (the conftest
selects it)."""

from __future__ import annotations

import pytest
import torch

from pegainfer.testing.triton_kernels import KERNEL_DEVICE as DEVICE
from pegainfer.testing.triton_kernels import requires_kernels
from pegainfer_qwen35.routing import softmax_topk_ref, softmax_topk_triton

pytestmark = requires_kernels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("experts,k,shared", [(256, 8, 1), (10, 3, 2)], ids=["256top8", "10top3"])
@pytest.mark.parametrize("norm", [True, False], ids=["norm", "raw"])
def test_softmax_topk_equals_its_reference(dtype, experts, k, shared, norm):
    gen = torch.Generator().manual_seed(experts + k)
    # Distinct logits (steps of 0.05, exact in bf16 too): ties are the next test's business.
    steps = torch.stack([torch.randperm(experts + 2, generator=gen) for _ in range(7)])
    logits = ((steps - experts / 2) * 0.05).to(dtype).to(DEVICE)[:, : experts + 1]
    weights, ids = softmax_topk_triton(logits, k, norm, dtype, shared)
    ref_weights, ref_ids = softmax_topk_ref(logits, k, norm, dtype, shared)
    assert weights.shape == ids.shape == (7, k + shared)
    assert weights.dtype == dtype and ids.dtype == torch.int64
    assert torch.equal(ids, ref_ids), "the same experts, best first, then the shared pieces"
    assert ids[:, k:].tolist() == [list(range(experts, experts + shared))] * 7
    tol = 1e-6 if dtype == torch.float32 else 2**-8
    torch.testing.assert_close(weights, ref_weights, rtol=tol, atol=tol)
    gate = torch.sigmoid(logits[:, experts:].float()).to(dtype)
    torch.testing.assert_close(weights[:, k:], gate.expand(-1, shared), rtol=tol, atol=tol)  # each piece
    if norm:
        torch.testing.assert_close(
            weights[:, :k].float().sum(-1), torch.ones(7, device=DEVICE), rtol=tol * 8, atol=tol * 8
        )


def test_softmax_topk_breaks_ties_to_the_lower_index():
    logits = torch.zeros(2, 13, device=DEVICE)
    logits[0, [3, 7, 9]] = 1.0
    weights, ids = softmax_topk_triton(logits, 4, True, torch.float32, 1)
    assert ids.tolist() == [[3, 7, 9, 0, 12], [0, 1, 2, 3, 12]]
    torch.testing.assert_close(weights[:, :4].sum(-1), torch.ones(2, device=DEVICE))


@pytest.mark.parametrize("select", [softmax_topk_triton, softmax_topk_ref], ids=["kernel", "ref"])
def test_padding_rows_take_row_zeros_selection(select):
    """``real_rows``: the rows before it select as without it, every later row (a prefill graph's padding)
    takes row 0's experts and weights, the shared gate's included, so the fused MoE reads no expert for it
    that row 0 does not."""
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(6, 65, generator=gen).to(DEVICE)
    free_weights, free_ids = softmax_topk_ref(logits, 8, True, torch.float32, 2)
    weights, ids = select(logits, 8, True, torch.float32, 2, torch.tensor([4], device=DEVICE))
    assert torch.equal(ids[:4], free_ids[:4]) and torch.equal(ids[4:], free_ids[:1].expand(2, -1))
    torch.testing.assert_close(weights[:4], free_weights[:4], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(weights[4:], free_weights[:1].expand(2, -1), atol=1e-6, rtol=1e-5)
    assert not torch.equal(free_ids[4:], free_ids[:1].expand(2, -1))  # the rows had choices of their own
