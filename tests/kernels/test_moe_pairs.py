"""The pair path of the routed experts (``pegainfer.kernels.moe_pairs``) against the reference loop
(``pegainfer.layers.moe.routed_experts``) and the grouped path, on fresh random inputs: 1..PAIR_TOKENS
tokens, tokens sharing an expert, widths no tile divides, fp32 and bf16, the shared experts' gated add
and the residual, block-FP8 experts; and which routings ``ops.fused_moe`` sends to it.

Without a GPU the kernels run through Triton's interpreter on CPU tensors (the conftest selects it).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kernel_helpers import moe_case, quantized_experts

from pegainfer import ops
from pegainfer.kernels import moe_pairs
from pegainfer.kernels.fused_moe import fused_moe_triton
from pegainfer.kernels.moe_pairs import (
    PAIR_TOKENS,
    PAIR_TOKENS_FP8,
    PairTiles,
    default_tiles,
    fused_moe_pairs,
    launches_early,
    takes_pairs,
)
from pegainfer.layers.moe import combine_routed, routed_experts

#: Small tiles, so the cases' widths (40 hidden, 24 expert features) take several, the last one ragged.
SMALL = PairTiles(gate_up_n=16, gate_up_k=16, down_n=16, down_k=16)
#: The same with the columns of gate|up split over programs (three splits of 40 columns: one is short).
SPLIT = dataclasses.replace(SMALL, gate_up_split=3)
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


@pytest.mark.parametrize("tiles", [SMALL, SPLIT], ids=["one-split", "three-splits"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tokens, k", [(1, 3), (PAIR_TOKENS, 2)], ids=["one-token", "most-tokens"])
def test_pairs_match_the_reference(dtype, tokens, k, tiles):
    x, weights, ids, gate_up, down = moe_case(tokens, k, 7, 40, 24, dtype, seed=tokens + k)
    ids[-1, 0] = ids[0, 0]  # with several tokens, two of them on one expert (a token's choices differ)
    ref = routed_experts(x, weights, ids, gate_up, down)
    ours = fused_moe_pairs(x, weights, ids, gate_up, down, tiles=tiles)
    torch.testing.assert_close(ours.float(), ref.float(), **TOL[dtype])
    # The same sums as the grouped path, each choice rounded where it rounds its own.
    grouped = fused_moe_triton(x, weights, ids, gate_up, down, block_n=16, block_k=16)
    one_ulp = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=2**-7, rtol=2**-7)
    torch.testing.assert_close(ours.float(), grouped.float(), **one_ulp)


@pytest.mark.parametrize("tiles", [SMALL, SPLIT], ids=["one-split", "three-splits"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_pairs_add_the_shared_output_into_the_residual(dtype, tiles):
    x, weights, ids, gate_up, down = moe_case(3, 4, 9, 40, 24, dtype, seed=5)
    routed = fused_moe_pairs(x, weights, ids, gate_up, down, tiles=tiles)
    shared = torch.randn_like(x)
    with_add = fused_moe_pairs(x, weights, ids, gate_up, down, add=shared, tiles=tiles)
    torch.testing.assert_close(with_add, combine_routed(routed, shared))
    residual = torch.randn_like(x)
    # The kernel adds the three terms before rounding once, the reference rounds after each step: their
    # roundings (half a unit in the last place each) are units of the largest partial sum, not of the
    # result, which cancellation can make smaller (seen on the GPU: 4 units of a 0.8 result).
    terms = residual.float().abs() + routed.float().abs() + shared.float().abs()
    two_ulps = torch.exp2(torch.floor(torch.log2(terms)) + 1 - (23 if dtype == torch.float32 else 7))
    want = combine_routed(routed, shared, residual.clone())
    got = fused_moe_pairs(x, weights, ids, gate_up, down, add=shared, residual=residual, tiles=tiles)
    assert got.data_ptr() == residual.data_ptr()
    off = (got.float() - want.float()).abs()
    assert (off <= two_ulps).all(), f"{int((off > two_ulps).sum())} outputs off by over 2 ulps: {off.max()}"


def test_pairs_default_tiles_mask_ragged_widths():
    x, weights, ids, gate_up, down = moe_case(2, 4, 6, 200, 72, torch.bfloat16, seed=3)
    ours = fused_moe_pairs(x, weights, ids, gate_up, down)
    torch.testing.assert_close(
        ours.float(), routed_experts(x, weights, ids, gate_up, down).float(), **TOL[torch.bfloat16]
    )


@pytest.mark.parametrize("tiles", [SMALL, SPLIT], ids=["one-split", "three-splits"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block, offset", [((16, 16), 0), ((32, 32), 16)], ids=["aligned", "shard-offset"])
def test_fp8_pairs_match_the_dequantized_reference(dtype, block, offset, tiles):
    """Float8 experts, each kernel tile inside one scale tile (a shard offset on a kernel tile included):
    the dot scaled by its tile's scale equals the reference over the experts dequantized whole."""
    x, weights, ids, gate_up, down = moe_case(2, 3, 7, 40, 24, dtype, seed=7)
    q_gate_up, q_down, scales = quantized_experts(gate_up, down, block, offset)
    assert takes_pairs(x, scales, tiles)
    ours = fused_moe_pairs(x, weights, ids, q_gate_up, q_down, scales=scales, tiles=tiles)
    ref = routed_experts(x, weights, ids, q_gate_up, q_down, scales=scales)
    torch.testing.assert_close(ours.float(), ref.float(), **TOL[dtype])


def test_which_routings_take_the_pair_path():
    x, weights, ids, gate_up, down = moe_case(PAIR_TOKENS + 1, 2, 6, 32, 32, torch.float32, seed=2)
    assert takes_pairs(x[:1], None) and takes_pairs(x[:PAIR_TOKENS], None)
    assert not takes_pairs(x, None) and not takes_pairs(x[:0], None)
    _, _, aligned = quantized_experts(gate_up, down, (128, 128), 0)
    # DeepSeek's 128 x 128 scale tiles at the default tiles, for fewer tokens than bf16 experts.
    fp8 = PAIR_TOKENS_FP8
    assert takes_pairs(x[:fp8], aligned) and not takes_pairs(x[: fp8 + 1], aligned)
    _, _, offset = quantized_experts(gate_up, down, (128, 128), 5)
    assert not takes_pairs(x[:1], offset)  # a kernel tile across two scale tiles: grouped path
    _, _, w8a8 = quantized_experts(gate_up, down, (128, 128), 0, fp8_activations=True)
    assert not takes_pairs(x[:1], w8a8)  # W8A8: the grouped path quantizes x and the activation first
    with pytest.raises(ValueError, match="pair path"):
        fused_moe_pairs(x, weights, ids, gate_up, down)


def test_small_experts_split_the_gate_up_columns():
    """Programs that fill under half a wave split their columns in two (Qwen3.5-35B-A3B at batch 1: 8
    pairs x 512 features in 64-feature tiles); wider experts and more tokens do not."""
    assert default_tiles(8, 512, 132).gate_up_split == 2
    assert default_tiles(6, 1408, 132).gate_up_split == 1  # Moonlight: 132 programs
    assert default_tiles(8, 2048, 132).gate_up_split == 1  # DeepSeek-V3
    assert default_tiles(16, 512, 132).gate_up_split == 1


def test_launches_start_early_only_where_gate_up_leaves_multiprocessors_idle():
    def early(pairs, inter, sms=132):
        return launches_early(pairs, inter, default_tiles(pairs, inter, sms), sms)

    assert early(9, 512)  # Qwen3.5-35B-A3B at one token: 72 programs
    assert not early(18, 512)  # two tokens: 144
    assert not early(6, 1408)  # Moonlight: 132, the machine full
    assert not early(8, 2048)  # DeepSeek-V3: 256
    assert early(2, 512, sms=64)  # split in two: 32 programs
    assert not early(4, 512, sms=64)  # 32 programs, split in two where that still fits: 64


def test_ops_sends_a_few_tokens_to_the_pair_path(monkeypatch):
    """Where Triton runs, ``ops.fused_moe`` takes the pair path for a decode step's few tokens and the
    grouped GEMMs for more."""
    monkeypatch.setattr(ops, "use_triton", lambda t: True)
    calls = []
    pairs, grouped = moe_pairs.fused_moe_pairs, fused_moe_triton
    monkeypatch.setattr(
        moe_pairs, "fused_moe_pairs", lambda *a, **kw: calls.append("pairs") or pairs(*a, **kw)
    )
    monkeypatch.setattr(
        "pegainfer.kernels.fused_moe.fused_moe_triton",
        lambda *a, **kw: calls.append("grouped") or grouped(*a, **kw),
    )
    for tokens in (1, PAIR_TOKENS + 1):
        x, weights, ids, gate_up, down = moe_case(tokens, 2, 5, 32, 16, torch.float32, seed=tokens)
        got = ops.fused_moe(x, weights, ids, gate_up, down)
        torch.testing.assert_close(got, routed_experts(x, weights, ids, gate_up, down), **TOL[torch.float32])
    assert calls == ["pairs", "grouped"]


def test_scales_on_unaligned_tiles_are_refused():
    x, weights, ids, gate_up, down = moe_case(1, 2, 4, 32, 32, torch.float32, seed=1)
    q_gate_up, q_down, scales = quantized_experts(gate_up, down, (16, 16), 0)
    with pytest.raises(ValueError, match="pair path"):
        fused_moe_pairs(x, weights, ids, q_gate_up, q_down, scales=scales)  # 32-wide tiles, 16-wide scales


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("tokens", [1, PAIR_TOKENS])
def test_early_launch_changes_no_bit(tokens):
    """With PDL the pair kernels and the combine start before the launch they follow has finished (down
    reads its expert ids before its wait): the output equals the one launched in order bit for bit,
    eager and in a graph, at the 35B-A3B experts' shape (hidden 2048, 512 features)."""
    x, weights, ids, gate_up, down = moe_case(tokens, 8, 64, 2048, 512, torch.bfloat16, seed=tokens)
    residual = torch.randn_like(x)
    expected = fused_moe_pairs(x, weights, ids, gate_up, down, residual=residual.clone(), early=False)
    early = fused_moe_pairs(x, weights, ids, gate_up, down, residual=residual.clone(), early=True)
    assert torch.equal(early, expected)
    into = residual.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_moe_pairs(x, weights, ids, gate_up, down, residual=into, early=True)
    into.copy_(residual)
    graph.replay()
    assert torch.equal(into, expected)
