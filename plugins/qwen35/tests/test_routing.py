"""The MoE expert selection kernels (``routing.softmax_topk``, and ``routing.norm_route_topk`` with the
norm and the router GEMM in its launch) against their torch references on fresh random inputs: strided rows (the router GEMM's output holds the shared gate's logit last, and the rows may be a
view of a wider buffer), a non-power-of-two expert count, with and without renormalisation, one shared
piece or several. Without a GPU through Triton's interpreter (the conftest
selects it)."""

from __future__ import annotations

import pytest
import torch

from pegainfer.testing.triton_kernels import KERNEL_DEVICE as DEVICE
from pegainfer.testing.triton_kernels import requires_kernels
from pegainfer_qwen35.norms import rms_norm_zero_centred_ref
from pegainfer_qwen35.routing import (
    ROUTE_ROWS,
    _workspace,
    norm_route_topk,
    softmax_topk_ref,
    softmax_topk_triton,
)

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tokens", [1, ROUTE_ROWS], ids=["one-row", "most-rows"])
def test_norm_route_topk_equals_norm_then_router_then_selection(dtype, tokens):
    """The one-launch form: the normed rows as the norm writes them, the logits as the GEMM gives them
    (rounded to the model dtype), the selection of those logits. Widths no tile divides: 1100 hidden
    features (512-wide steps), 37 experts + the shared gate (8 router rows a program, 5 programs)."""
    experts, hidden, k, eps = 37, 1100, 4, 1e-6
    gen = torch.Generator().manual_seed(tokens)
    x = (torch.randn(tokens, hidden, generator=gen) * 3).to(dtype).to(DEVICE)
    norm_weight = (torch.randn(hidden, generator=gen) * 0.1).to(dtype).to(DEVICE)
    router = (torch.randn(experts + 1, hidden, generator=gen) * hidden**-0.5).to(dtype).to(DEVICE)
    normed = torch.empty_like(x)
    weights, ids = norm_route_topk(x, norm_weight, router, eps, k, True, 1, normed)
    want_normed = rms_norm_zero_centred_ref(x, norm_weight, eps)
    ulp = 0 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(normed, want_normed, atol=1e-6, rtol=max(ulp, 1e-6))
    logits = (want_normed.float() @ router.float().t()).to(dtype)
    kernel_logits = _workspace(x.device, experts + 1)[0][:tokens]
    torch.testing.assert_close(kernel_logits, logits.float(), atol=1e-5, rtol=max(ulp, 1e-5))
    # The selection is that of the kernel's own logits (in bf16 an ulp can reorder close experts) ...
    ref_weights, ref_ids = softmax_topk_ref(kernel_logits.to(dtype), k, True, dtype, 1)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=max(ulp, 1e-6))
    # ... and in fp32 that of the three launches' exactly.
    if dtype == torch.float32:
        assert torch.equal(ids, softmax_topk_ref(logits, k, True, dtype, 1)[1])
    # The arrival counters are back at zero for the next launch (a CUDA graph replays it as it is).
    assert not _workspace(x.device, experts + 1)[1].any()


def test_norm_and_route_takes_the_launch_for_a_few_rows_only(monkeypatch):
    import pegainfer_qwen35.routing as routing

    calls = []
    monkeypatch.setattr(routing, "use_triton", lambda t: True)
    monkeypatch.setattr(routing, "norm_route_topk", lambda *a: calls.append(a[0].shape[0]) or ("w", "i"))
    x = torch.randn(ROUTE_ROWS + 1, 16)
    assert routing.norm_and_route(x[:1], None, None, 1e-6, 2, True, 1, None, None) == ("w", "i")
    monkeypatch.setattr(routing, "use_triton", lambda t: False)
    w = torch.zeros(16)
    router = torch.randn(5, 16)
    normed, logits = torch.empty(ROUTE_ROWS + 1, 16), torch.empty(ROUTE_ROWS + 1, 5)
    weights, ids = routing.norm_and_route(x, w, router, 1e-6, 2, True, 1, normed, logits)
    assert calls == [1] and ids.shape == (ROUTE_ROWS + 1, 3)
    torch.testing.assert_close(normed, rms_norm_zero_centred_ref(x, w, 1e-6))
