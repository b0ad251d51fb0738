"""The fused MoE kernels (``pegainfer.kernels.fused_moe``) against the reference loop
(``pegainfer.layers.moe.routed_experts``) on fresh random inputs: tokens routed to repeated and unused experts, feature sizes that are not tile multiples, the
decode tile (16 rows a block) and the prefill one (64), fp32 and bf16; and the device-side expert blocks.

Without a GPU the kernels run through Triton's interpreter on CPU tensors (the conftest selects it); with
one, compiled, and the ``gpu``-marked cases at DeepSeek-V3's expert shape inside a CUDA graph.
"""

from __future__ import annotations

import os

import pytest
import torch

from pegainfer.kernels.fused_moe import expert_blocks, fused_moe_triton
from pegainfer.layers.moe import routed_experts
from pegainfer.ops import fused_moe

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs a GPU or Triton's interpreter (TRITON_INTERPRET=1 before Triton)",
)


def _case(tokens, k, experts, hidden, inter, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(tokens, hidden, generator=gen) * 0.5).to(DEVICE, dtype)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5).to(DEVICE, dtype)
    down = (torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5).to(DEVICE, dtype)
    # Distinct experts per token, from a skewed pool: some experts get many tokens, some none.
    ids = torch.stack([torch.randperm(experts - 1, generator=gen)[:k] for _ in range(tokens)]).to(DEVICE)
    weights = torch.rand(tokens, k, generator=gen).to(DEVICE) * 2.5
    return x, weights, ids, gate_up, down


def test_expert_blocks_sort_and_pad_the_pairs():
    ids = torch.tensor([[2, 0], [2, 3], [0, 2]], device=DEVICE)
    rows, block_expert = expert_blocks(ids, 5, 4)
    p = 6
    assert rows.numel() == block_expert.numel() * 4 == 4 * -(-(p + 5 * 3) // 4)
    # Expert 0 gets pairs 1 and 4, expert 2 pairs 0, 2, 5, expert 3 pair 3; each run padded to 4 rows.
    assert rows[:12].tolist() == [1, 4, p, p, 0, 2, 5, p, 3, p, p, p]
    assert block_expert.tolist()[:3] == [0, 2, 3] and set(block_expert.tolist()[3:]) == {5}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tokens, block_m", [(5, None), (9, 64)], ids=["decode", "prefill"])
def test_fused_moe_matches_reference(dtype, tokens, block_m):
    x, weights, ids, gate_up, down = _case(tokens, 3, 7, 40, 24, dtype, seed=tokens)
    ours = fused_moe_triton(x, weights, ids, gate_up, down, block_m=block_m, block_n=16, block_k=16)
    ref = routed_experts(x, weights, ids, gate_up, down)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(ours.float(), ref.float(), **tol)


def test_dispatch_takes_the_reference_off_cuda(monkeypatch):
    x, weights, ids, gate_up, down = _case(2, 2, 4, 16, 16, torch.float32, seed=1)
    calls = []
    monkeypatch.setattr("pegainfer.ops.routed_experts", lambda *a: calls.append(a) or routed_experts(*a))
    torch.testing.assert_close(
        fused_moe(x, weights, ids, gate_up, down), routed_experts(x, weights, ids, gate_up, down)
    )
    assert bool(calls) == (DEVICE == "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("tokens", [1, 32, 512])
def test_deepseek_v3_expert_shape_inside_a_cuda_graph(tokens):
    """256 experts of 7168 → 2048, top-8, bf16, replayed from a graph after the routing changed."""
    x, weights, ids, gate_up, down = _case(tokens, 8, 256, 7168, 2048, torch.bfloat16, seed=tokens)
    fused_moe(x, weights, ids, gate_up, down)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, weights, ids, gate_up, down)
    ids.copy_(torch.stack([torch.randperm(256, device=DEVICE)[:8] for _ in range(tokens)]))
    graph.replay()
    ref = routed_experts(x, weights, ids, gate_up, down)
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)
