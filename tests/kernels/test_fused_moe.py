"""The fused MoE kernels (``pegainfer.kernels.fused_moe``) against the reference loop
(``pegainfer.layers.moe.routed_experts``) on fresh random inputs: tokens routed to repeated and unused experts, feature sizes that are not tile multiples, the
decode tile (16 rows a block) and the prefill one (64), fp32 and bf16; and the device-side expert blocks.

Without a GPU the kernels run through Triton's interpreter on CPU tensors (the conftest selects it); with
one, compiled, and the ``gpu``-marked cases at DeepSeek-V3's expert shape inside a CUDA graph.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from kernel_helpers import moe_case, quantized_experts

from pegainfer.kernels import fused_moe as fused_moe_kernels
from pegainfer.kernels.fused_moe import (
    KERNEL_SORT_PAIRS,
    expert_blocks,
    expert_blocks_torch,
    expert_blocks_triton,
    fused_moe_triton,
)
from pegainfer.layers.moe import BlockScales, combine_routed, routed_experts
from pegainfer.ops import fused_moe

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs a GPU or Triton's interpreter (TRITON_INTERPRET=1 before Triton)",
)


def test_expert_blocks_sort_and_pad_the_pairs():
    ids = torch.tensor([[2, 0], [2, 3], [0, 2]], device=DEVICE)
    rows, block_expert = expert_blocks(ids, 5, 4)
    p = 6
    assert rows.numel() == block_expert.numel() * 4 == 4 * -(-(p + 5 * 3) // 4)
    # Expert 0 gets pairs 1 and 4, expert 2 pairs 0, 2, 5, expert 3 pair 3; each run padded to 4 rows.
    assert rows[:12].tolist() == [1, 4, p, p, 0, 2, 5, p, 3, p, p, p]
    assert block_expert.tolist()[:3] == [0, 2, 3] and set(block_expert.tolist()[3:]) == {5}


def test_the_grid_covers_the_chosen_experts_not_all_of_them():
    """A batch-1 routing of 8 of 256 experts: 8 blocks (one per chosen expert, all used), not one per
    expert; a routing of many tokens into few experts is still covered."""
    ids = torch.tensor([[200, 3, 17, 255, 0, 64, 65, 128]], device=DEVICE)
    rows, block_expert = expert_blocks(ids, 256, 16)
    assert block_expert.numel() == 8 and sorted(block_expert.tolist()) == sorted(ids[0].tolist())
    many = torch.tensor([[0, 1]] * 40, device=DEVICE)  # 80 pairs, 2 experts: 3 blocks each, none spare
    rows, block_expert = expert_blocks(many, 256, 16)
    assert block_expert.tolist()[:6] == [0, 0, 0, 1, 1, 1] and set(block_expert.tolist()[6:]) <= {256}


@pytest.mark.parametrize(
    "tokens, k, experts, block_m",
    [(1, 8, 256, 16), (3, 2, 5, 4), (32, 8, 256, 16), (KERNEL_SORT_PAIRS // 6, 6, 64, 16), (7, 4, 20, 64)],
    ids=["v3-decode", "tiny", "v3-batch32", "largest", "prefill-tile"],
)
def test_one_program_expert_blocks_equal_the_torch_form(tokens, k, experts, block_m):
    """The one-program sort writes exactly the torch form's rows and block experts, with experts chosen by
    many tokens, by one, and by none (a skewed pool), and the padding past the routing's last block."""
    gen = torch.Generator().manual_seed(tokens * 31 + experts)
    pool = max(k, experts // 3)  # a third of the experts take every choice: long runs, many empty experts
    ids = torch.stack([torch.randperm(pool, generator=gen)[:k] for _ in range(tokens)]).to(DEVICE)
    rows, block_expert = expert_blocks_triton(ids, experts, block_m)
    want_rows, want_blocks = expert_blocks_torch(ids, experts, block_m)
    assert torch.equal(rows, want_rows)
    assert torch.equal(block_expert, want_blocks)


def test_the_one_program_sort_refuses_a_routing_past_its_size():
    ids = torch.zeros(KERNEL_SORT_PAIRS + 1, 1, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="at most"):
        expert_blocks_triton(ids, 4, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tokens, block_m", [(5, None), (9, 64)], ids=["decode", "prefill"])
def test_fused_moe_matches_reference(dtype, tokens, block_m):
    x, weights, ids, gate_up, down = moe_case(tokens, 3, 7, 40, 24, dtype, seed=tokens)
    ours = fused_moe_triton(x, weights, ids, gate_up, down, block_m=block_m, block_n=16, block_k=16)
    ref = routed_experts(x, weights, ids, gate_up, down)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(ours.float(), ref.float(), **tol)
    shared = torch.randn_like(x)  # the shared experts' output, added in the launch that sums the choices
    with_add = fused_moe_triton(
        x, weights, ids, gate_up, down, block_m=block_m, block_n=16, block_k=16, add=shared
    )
    torch.testing.assert_close(with_add.float(), (ref + shared).float(), **tol)
    # The shared experts' output added into the residual stream in place: each step rounded as torch does.
    residual = torch.randn_like(x)
    want = combine_routed(ours, shared, residual.clone())
    got = fused_moe_triton(
        x, weights, ids, gate_up, down, block_m=block_m, block_n=16, block_k=16, add=shared, residual=residual
    )
    assert got.data_ptr() == residual.data_ptr()
    one_ulp = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=2**-7, rtol=2**-7)
    torch.testing.assert_close(got.float(), want.float(), **one_ulp)


@pytest.mark.parametrize("tokens", [1, 40], ids=["decode-tiles", "prefill-tiles"])
def test_fused_moe_default_tiles_mask_ragged_widths(tokens):
    """The tiles ``fused_moe_triton`` picks itself (128-column loads for decode blocks, 64 otherwise) over
    a hidden size and an expert width that no tile divides."""
    x, weights, ids, gate_up, down = moe_case(tokens, 4, 6, 200, 72, torch.bfloat16, seed=tokens + 1)
    ours = fused_moe_triton(x, weights, ids, gate_up, down)
    ref = routed_experts(x, weights, ids, gate_up, down)
    torch.testing.assert_close(ours.float(), ref.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize(
    "smem_kib, block_m, act, weights, pipeline",
    [
        (228, 16, torch.bfloat16, torch.bfloat16, (128, 4)),
        (228, 16, torch.bfloat16, torch.float8_e4m3fn, (128, 4)),
        (100, 16, torch.bfloat16, torch.float8_e4m3fn, (128, 4)),  # 80 KiB of stages fit
        (100, 16, torch.bfloat16, torch.bfloat16, (64, 3)),  # 144 KiB would not
        (228, 64, torch.bfloat16, torch.bfloat16, (64, 3)),
        (228, 16, torch.float32, torch.float32, (64, 3)),
    ],
    ids=["h200-bf16", "h200-fp8", "100k-fp8", "100k-bf16", "prefill-blocks", "fp32"],
)
def test_decode_pipeline_fits_the_devices_shared_memory(
    monkeypatch, smem_kib, block_m, act, weights, pipeline
):
    monkeypatch.setattr(fused_moe_kernels, "shared_memory_per_sm", lambda device: smem_kib * 1024)
    x, gate_up = torch.empty(1, 8, dtype=act), torch.empty(1, 8, 8, dtype=weights)
    assert fused_moe_kernels.default_pipeline(block_m, 64, x, gate_up) == pipeline


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "block, offset, act8, block_k",
    [
        ((16, 16), 0, False, 16),
        ((16, 32), 0, False, 16),
        ((32, 32), 16, False, 16),
        ((32, 32), 5, False, 16),
        ((32, 32), 0, True, 32),
        ((32, 32), 0, True, 16),
        ((64, 64), 32, True, 32),
        ((32, 32), 5, True, 32),
    ],
    ids=[
        "aligned",
        "oblong",
        "shard-offset-on-a-kernel-tile",
        "shard-offset",
        "w8a8-aligned",
        "w8a8-narrower-than-the-mma",
        "w8a8-shard-offset-on-a-kernel-tile",
        "w8a8-shard-offset",
    ],
)
def test_fp8_experts_match_the_dequantized_reference(dtype, block, offset, act8, block_k):
    """Float8 experts dequantized in the kernels equal the reference loop over the same float8 experts (each
    dequantized whole), with tiles wider than a kernel tile and a shard that starts inside its first tile:
    the first three W8A16 cases scale each dot by its tile's one scale, the last scales every element.
    W8A8: x and the activation quantized per token and tile of columns (on I's tiles from the shard's
    offset), the float8 operands multiplied as they are where a 32-column load sits in one scale tile
    (the FP8 tensor cores take 32 columns at a time), per element in fp32 elsewhere."""
    x, weights, ids, gate_up, down = moe_case(6, 3, 7, 40, 24 if block[1] < 64 else 72, dtype, seed=7)
    q_gate_up, q_down, scales = quantized_experts(gate_up, down, block, offset, fp8_activations=act8)
    ours = fused_moe_triton(x, weights, ids, q_gate_up, q_down, scales=scales, block_n=16, block_k=block_k)
    ref = routed_experts(x, weights, ids, q_gate_up, q_down, scales=scales)
    # fp32: Hopper's FP8 tensor cores add a tile's products with ~14 mantissa bits (W8A8 on a GPU).
    fp32_tol = 2e-4 if act8 else 1e-5
    tol = dict(atol=fp32_tol, rtol=fp32_tol) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(ours.float(), ref.float(), **tol)
    if act8:  # the activations' rounding is in both: far from the W8A16 reference
        w8a16_scales = dataclasses.replace(scales, fp8_activations=False)
        w8a16 = routed_experts(x, weights, ids, q_gate_up, q_down, scales=w8a16_scales)
        assert (ref.float() - w8a16.float()).norm() > 5e-3 * w8a16.float().norm()
    # The dequantized experts are the originals within float8's rounding (a tile's scale misplaced by the
    # offset would be off by the ratio of two tiles' maxima).
    for e in range(gate_up.shape[0]):
        w_gate_up, w_down = scales.dequantize(e, q_gate_up[e], q_down[e], torch.float32)
        for ours_w, orig in ((w_gate_up, gate_up[e]), (w_down, down[e])):
            assert (ours_w - orig.float()).norm() < 0.04 * orig.float().norm()


@pytest.mark.parametrize("act8", [False, True], ids=["w8a16", "w8a8"])
@pytest.mark.parametrize("offset", [0, 24], ids=["aligned", "shard-offset"])
def test_fp8_experts_at_the_default_decode_tiles(offset, act8):
    """Float8 experts in DeepSeek's 128 x 128 scale tiles at the tiles ``fused_moe_triton`` picks for a
    decode batch (64 x 128 weight tiles): one scale a kernel tile when aligned, per element past a shard
    offset; widths no tile divides."""
    x, weights, ids, gate_up, down = moe_case(1, 4, 6, 200, 72, torch.bfloat16, seed=11)
    q_gate_up, q_down, scales = quantized_experts(gate_up, down, (128, 128), offset, fp8_activations=act8)
    ours = fused_moe_triton(x, weights, ids, q_gate_up, q_down, scales=scales)
    ref = routed_experts(x, weights, ids, q_gate_up, q_down, scales=scales)
    torch.testing.assert_close(ours.float(), ref.float(), atol=3e-2, rtol=3e-2)


def test_a_shard_offset_needs_square_tiles():
    with pytest.raises(ValueError, match="square tiles"):
        BlockScales(torch.ones(1, 2, 1, 1), torch.ones(1, 1, 1), (16, 32), offset=5)


def test_quantized_experts_need_their_scales():
    x, weights, ids, gate_up, down = moe_case(2, 2, 4, 16, 16, torch.float32, seed=1)
    q_gate_up, q_down, scales = quantized_experts(gate_up, down, (16, 16), 0)
    with pytest.raises(ValueError, match="block scales"):
        fused_moe_triton(x, weights, ids, q_gate_up, q_down)
    with pytest.raises(ValueError, match="block scales"):
        fused_moe_triton(x, weights, ids, gate_up, down, scales=scales)


def test_dispatch_takes_the_reference_off_cuda(monkeypatch):
    x, weights, ids, gate_up, down = moe_case(2, 2, 4, 16, 16, torch.float32, seed=1)
    calls = []
    monkeypatch.setattr(
        "pegainfer.ops.routed_experts", lambda *a, **kw: calls.append(a) or routed_experts(*a, **kw)
    )
    torch.testing.assert_close(
        fused_moe(x, weights, ids, gate_up, down), routed_experts(x, weights, ids, gate_up, down)
    )
    assert bool(calls) == (DEVICE == "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("tokens", [1, 32, 512])
def test_deepseek_v3_expert_shape_inside_a_cuda_graph(tokens):
    """256 experts of 7168 → 2048, top-8, bf16, replayed from a graph after the routing changed."""
    x, weights, ids, gate_up, down = moe_case(tokens, 8, 256, 7168, 2048, torch.bfloat16, seed=tokens)
    fused_moe(x, weights, ids, gate_up, down)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, weights, ids, gate_up, down)
    ids.copy_(torch.stack([torch.randperm(256, device=DEVICE)[:8] for _ in range(tokens)]))
    graph.replay()
    ref = routed_experts(x, weights, ids, gate_up, down)
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)
