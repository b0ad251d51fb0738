"""The W8A8 block-FP8 GEMM and its activation quantizer vs their torch references, on fresh random float8
weights, scales and activations.

The quantizer is exact: the kernel's float8 values and scales equal the reference's bit for bit. The
GEMM multiplies the same float8 operands (their products are exact in fp32) and applies both scales
per tile, where the reference multiplies the dequantized operands in fp32. Through the interpreter the
two differ only in fp32 rounding; Hopper's FP8 tensor cores add up a tile's 128 products with fewer
mantissa bits than fp32 (~14, DeepSeek-V3's report; measured 7.7e-5 relative on an H100), so fp32
outputs are held to 2e-4 and 16-bit ones to their own rounding.
"""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import DEVICE, fp8_weight, random_x, rel_err, shared_fp8_weight

from pegainfer.kernels.act_quant import quantize_activations
from pegainfer.kernels.block_fp8_w8a8 import block_fp8_w8a8_triton, default_tiles
from pegainfer.layers.activation import interleave_gate_up
from pegainfer.layers.block_fp8 import (
    BlockFP8Weight,
    block_fp8_linear_ref,
    dequantize_activations,
    quantize_activations_ref,
)

TOL = {torch.float32: 2e-4, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("m", "k", "offset"), [(3, 256, 0), (9, 300, 0), (5, 200, 40)])
def test_quantizer_matches_the_reference_bit_for_bit(dtype, m, k, offset):
    gen = torch.Generator().manual_seed(m + k)
    x = random_x(gen, m, k, dtype=dtype) * torch.logspace(-4, 3, k).to(dtype).to(DEVICE)  # every binade
    x[0, :10] = 0.0  # a group with zeros; row 1's first group all zero
    x[1, : 128 - offset] = 0.0
    q, s = quantize_activations(x, 128, offset)
    q_ref, s_ref = quantize_activations_ref(x, 128, offset)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(s, s_ref)
    assert torch.isfinite(dequantize_activations(q, s, 128, offset)).all()


def test_reference_groups_follow_the_weight_tiles():
    """Group g of a shard starting 3 columns into 4-column tiles holds columns [4g - 3, 4g + 1): column 0
    alone, then 1..4; each group's largest magnitude maps to 448."""
    x = torch.tensor([[1.0, 2.0, 4.0, 8.0, 0.5]])
    q, s = quantize_activations_ref(x, 4, offset=3)
    assert torch.equal(s, torch.tensor([[1.0, 8.0]]) / 448)
    assert q.float().tolist() == [[448.0, 112.0, 224.0, 448.0, 28.0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    ("m", "n", "k", "block", "offset", "tiles"),
    [
        (1, 64, 256, 128, 0, (16, 32, 4, 2)),  # a decode row
        (3, 70, 200, 128, 0, (16, 32, 4, 2)),  # ragged N and K
        (5, 48, 160, 64, 40, (16, 16, 4, 2)),  # columns from inside a tile: groups on the weight's grid
        (20, 40, 96, 32, 0, None),  # the default tiles
        (70, 96, 256, 128, 0, (32, 32, 4, 2)),  # rows over three programs
        (130, 36, 64, 128, 7, None),  # prefill's default tiles, columns offset
    ],
    ids=["1x64x256", "3x70x200-ragged", "5x48x160-offset", "20x40x96-block32", "70x96x256-rows", "130x36x64"],
)
def test_matches_the_w8a8_reference(dtype, m, n, k, block, offset, tiles):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    w = fp8_weight(gen, n, k, block, offset)
    x = random_x(gen, m, k, dtype=dtype)
    bias = random_x(gen, n, dtype=dtype)
    out = block_fp8_w8a8_triton(x, w, bias, tiles=tiles)
    ref = block_fp8_linear_ref(x.float(), w, bias.float(), fp8_activations=True)
    assert out.dtype == dtype and out.shape == (m, n)
    assert rel_err(out, ref) < TOL[dtype]
    # The activations' rounding is what separates W8A8 from W8A16: e4m3 keeps 3 mantissa bits.
    assert 5e-3 < rel_err(ref, block_fp8_linear_ref(x.float(), w, bias.float())) < 6e-2


@pytest.mark.parametrize("m", [2, 80], ids=["decode", "prefill"])
def test_silu_of_interleaved_gate_up_and_the_residual_add(m):
    gen = torch.Generator().manual_seed(m)
    inter, hidden = 48, 256
    gate, up = fp8_weight(gen, inter, hidden, 128), fp8_weight(gen, inter, hidden, 128)
    gate_up = BlockFP8Weight(2 * inter, hidden, 128).to(DEVICE)
    gate_up.load_rows(
        slice(0, 2 * inter),
        interleave_gate_up(gate.weight, up.weight),
        interleave_gate_up(gate.scale, up.scale),
    )
    x = random_x(gen, m, hidden, dtype=torch.float32)
    act = block_fp8_w8a8_triton(x, gate_up, silu=True)
    assert act.shape == (m, inter)
    assert rel_err(act, block_fp8_linear_ref(x, gate_up, silu=True, fp8_activations=True)) < TOL[x.dtype]
    down = fp8_weight(gen, hidden, inter, 128)
    residual = random_x(gen, m, hidden, dtype=torch.float32)
    expected = residual + block_fp8_linear_ref(act, down, fp8_activations=True)
    out = block_fp8_w8a8_triton(act, down, residual=residual)
    assert out.data_ptr() == residual.data_ptr()  # in place
    assert rel_err(out, expected) < TOL[x.dtype]


@pytest.mark.parametrize("interleaved", [False, True], ids=["period1", "period2"])
def test_tiles_load_the_scales_their_rows_share(interleaved):
    """Rows sharing their scales in tiles (gate and up interleaved: alternately), settled: a tile of rows
    loads one or two scales, with the sums of every row's own."""
    gen = torch.Generator().manual_seed(9)
    w = shared_fp8_weight(gen, 96, 256, 32, interleaved)
    tiles = (16, 32, 4, 2)
    assert w.scale_period(tiles[1]) == (2 if interleaved else 1)
    x = random_x(gen, 3, 256, dtype=torch.bfloat16)
    out = block_fp8_w8a8_triton(x, w, tiles=tiles)
    assert rel_err(out, block_fp8_linear_ref(x.float(), w, fp8_activations=True)) < TOL[x.dtype]
    w.scale_groups = None  # each row's own scales
    torch.testing.assert_close(block_fp8_w8a8_triton(x, w, tiles=tiles), out, atol=0, rtol=0)


def test_default_tiles_fill_the_multiprocessors():
    """The widest weight tiles whose programs fill 80% of their last wave: DeepSeek-V3's q_b (24576 rows)
    in 64-row tiles (384 programs, 97% of three waves; 128-row tiles fill 73%), o_proj (7168) in 64
    (85% of one wave), the shared gate|up (4096) in 32 (97%)."""
    assert default_tiles(24576, 1) == (16, 64, 4, 6)
    assert default_tiles(7168, 1)[1] == 64
    assert default_tiles(4096, 16)[1] == 32
    assert default_tiles(32768, 1)[1] == 128  # 256 programs: 97% of two waves
    assert default_tiles(24576, 4096)[:2] == (64, 128)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("m", "n", "k"), [(1, 2112, 7168), (16, 7168, 2048), (300, 4096, 7168)])
def test_deepseek_v3_shapes_on_the_gpu(m, n, k):
    """DeepSeek-V3's q_a|kv_a at a decode row, the shared down at 16 rows and a 300-token prefill of the
    shared gate|up, with the default tiles, in bf16 against the fp32 W8A8 product."""
    gen = torch.Generator().manual_seed(n)
    w = fp8_weight(gen, n, k, 128)
    x = random_x(gen, m, k, dtype=torch.bfloat16)
    ref = block_fp8_linear_ref(x.float(), w, fp8_activations=True)
    assert rel_err(block_fp8_w8a8_triton(x, w), ref) < 1e-2


def test_tiles_the_kernel_cannot_take_are_refused():
    """Quantization tiles under 32 columns (the FP8 MMA's K) or over 128 (the pipeline's shared memory)."""
    gen = torch.Generator().manual_seed(1)
    for block in (16, 256):
        with pytest.raises(ValueError, match="32, 64 or 128 columns"):
            block_fp8_w8a8_triton(random_x(gen, 1, 256, dtype=torch.float32), fp8_weight(gen, 16, 256, block))
