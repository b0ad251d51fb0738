"""The block-FP8 GEMM kernel vs its torch reference (the weight dequantized, then ``F.linear``) on fresh
random float8 weights and scales.

The kernel scales a row's fp32 partial sum per quantization tile where the reference rounds every
dequantized weight to the activations' dtype first, so 16-bit outputs differ by a few ulps of the
weights' rounding; the bound is relative to the output scale. fp32 agrees to 1e-5 (the same products
in another order).
"""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import DEVICE, fp8_weight, random_x, rel_err, shared_fp8_weight

from pegainfer.kernels.block_fp8_gemm import (
    Fp8GemmConfig,
    block_fp8_linear_triton,
    default_config,
    dequantize_into,
    widened_scratch,
)
from pegainfer.kernels.skinny_gemm import SkinnyConfig, skinny_linear_triton
from pegainfer.layers.activation import interleave_gate_up
from pegainfer.layers.block_fp8 import BlockFP8Weight, block_fp8_linear_ref, row_scales, widened_bytes

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    ("m", "n", "k", "block", "offset", "config"),
    [
        (1, 64, 256, 128, 0, Fp8GemmConfig(16, 32, 128)),  # one scale per tile row (the uniform path)
        (3, 70, 200, 128, 0, Fp8GemmConfig(16, 32, 64)),  # ragged N and K, two kernel tiles per scale
        (5, 48, 160, 64, 40, Fp8GemmConfig(16, 16, 32)),  # columns from inside a tile: scaled per element
        (20, 40, 96, 32, 0, None),  # the default tiles shrink to the 32-column quantization tiles
        (4, 40, 200, 32, 0, Fp8GemmConfig(16, 16, 128)),  # four quantization tiles per load, ragged K
        (70, 96, 128, 128, 0, Fp8GemmConfig(32, 32, 64, num_stages=2)),  # rows over three programs
        (130, 36, 64, 128, 7, None),  # prefill's default tiles, columns offset
    ],
    ids=[
        "1x64x256",
        "3x70x200-ragged",
        "5x48x160-offset",
        "20x40x96-block32",
        "4x40x200-span4",
        "70x96x128-rows",
        "130x36x64",
    ],
)
def test_matches_the_dequantized_reference(dtype, m, n, k, block, offset, config):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    w = fp8_weight(gen, n, k, block, offset)
    x = random_x(gen, m, k, dtype=dtype)
    bias = random_x(gen, n, dtype=dtype)
    out = block_fp8_linear_triton(x, w, bias, config=config)
    ref = block_fp8_linear_ref(x.float(), w, bias.float())
    assert out.dtype == dtype and out.shape == (m, n)
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    ("m", "n", "k", "block", "config"),
    [
        (1, 64, 256, 128, SkinnyConfig(32, 64)),  # loads inside a tile
        (3, 70, 200, 32, SkinnyConfig(32, 128)),  # loads over four tiles, ragged N and K
        (16, 96, 512, 128, SkinnyConfig(32, 256, stream_k=True, programs=5)),  # tiles split over programs
        (2, 40, 96, 32, None),  # the dispatch: decode rows of a weight from a tile boundary
    ],
    ids=["inside-a-tile", "span4-ragged", "stream_k", "dispatch"],
)
def test_skinny_gemm_float8_form(dtype, m, n, k, block, config):
    gen = torch.Generator().manual_seed(m * 7 + n)
    w = fp8_weight(gen, n, k, block)
    x = random_x(gen, m, k, dtype=dtype)
    bias = random_x(gen, n, dtype=dtype)
    if config is None:
        out = block_fp8_linear_triton(x, w, bias)
    else:
        out = skinny_linear_triton(x, w, bias, config=config)
    assert out.dtype == dtype
    assert rel_err(out, block_fp8_linear_ref(x.float(), w, bias.float())) < TOL[dtype]


@pytest.mark.parametrize("interleaved", [False, True], ids=["period1", "period2"])
def test_rows_sharing_scales_are_found(interleaved):
    gen = torch.Generator().manual_seed(5)
    w = shared_fp8_weight(gen, 200, 256, 64, interleaved)
    assert w.scale_groups == ((128, 2) if interleaved else (64, 1))  # 64-row tiles, alternating: 128 rows
    assert w.scale_period(32) == (2 if interleaved else 1)
    assert w.scale_period(256) == 0  # a tile of rows would span groups
    w.load_rows(slice(0, 1), w.weight[:1].clone(), w.scale[:1] * 2)
    assert w.scale_groups is None and w.scale_period(32) == 0  # loading again: examined anew
    w.settle_scales()
    assert w.scale_groups is None  # row 0 alone differs: every row its own
    own = fp8_weight(gen, 40, 64, 32)
    own.settle_scales()
    assert own.scale_groups is None
    shared = shared_fp8_weight(gen, 64, 64, 32, False)
    shared.load_state_dict({k: v.clone() for k, v in shared.state_dict().items()})
    assert shared.scale_groups is None  # scales from a state dict: not yet examined


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("interleaved", [False, True], ids=["period1", "period2"])
@pytest.mark.parametrize(
    ("m", "n", "k", "config"),
    [
        (1, 96, 256, SkinnyConfig(32, 256)),  # two quantization tiles a load
        (3, 96, 512, SkinnyConfig(32, 128, stream_k=True, programs=5)),  # tiles split over programs
        (2, 100, 384, Fp8GemmConfig(16, 32, 128)),  # this module's kernel, one scale per tile row
        (2, 100, 384, Fp8GemmConfig(16, 32, 256)),  # two a load
    ],
    ids=["skinny", "stream_k", "tiles", "tiles-span2"],
)
def test_tiles_load_the_scales_their_rows_share(dtype, interleaved, m, n, k, config):
    """A tile of rows inside one group of rows that share their scales loads them once (or twice,
    alternating): the same result as every row's own."""
    gen = torch.Generator().manual_seed(m + n + k)
    w = shared_fp8_weight(gen, n, k, 32, interleaved)
    assert w.scale_period(config.block_n) == (2 if interleaved else 1)
    x = random_x(gen, m, k, dtype=dtype)
    run = skinny_linear_triton if isinstance(config, SkinnyConfig) else block_fp8_linear_triton
    out = run(x, w, config=config)
    assert rel_err(out, block_fp8_linear_ref(x.float(), w)) < TOL[dtype]
    w.scale_groups = None  # each row's own scales: the same sums
    torch.testing.assert_close(run(x, w, config=config), out, atol=0, rtol=0)


def test_skinny_gemm_refuses_float8_columns_inside_a_tile():
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="tile boundary"):
        skinny_linear_triton(random_x(gen, 1, 64, dtype=torch.float32), fp8_weight(gen, 16, 64, 32, offset=8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m", [2, 80, 140], ids=["skinny", "tiles", "widened"])
def test_silu_of_interleaved_gate_up_and_the_residual_add(dtype, m):
    gen = torch.Generator().manual_seed(m)
    inter, hidden = 48, 256
    gate, up = fp8_weight(gen, inter, hidden, 128), fp8_weight(gen, inter, hidden, 128)
    gate_up = BlockFP8Weight(2 * inter, hidden, 128).to(DEVICE)
    gate_up.load_rows(
        slice(0, 2 * inter),
        interleave_gate_up(gate.weight, up.weight),
        interleave_gate_up(gate.scale, up.scale),
    )
    x = random_x(gen, m, hidden, dtype=dtype)
    act = block_fp8_linear_triton(x, gate_up, silu=True)
    assert act.shape == (m, inter)
    assert rel_err(act, block_fp8_linear_ref(x.float(), gate_up, silu=True)) < TOL[dtype]
    down = fp8_weight(gen, hidden, inter, 128)
    residual = random_x(gen, m, hidden, dtype=dtype)
    expected = residual.float() + block_fp8_linear_ref(act.float(), down)
    out = block_fp8_linear_triton(act, down, residual=residual)
    assert out.data_ptr() == residual.data_ptr()  # in place
    assert rel_err(out, expected) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dequantize_kernel_rounds_as_the_reference(dtype):
    gen = torch.Generator().manual_seed(9)
    w = fp8_weight(gen, 40, 300, 128, offset=5)
    out = dequantize_into(w, torch.empty(40, 300, dtype=dtype, device=DEVICE))
    assert torch.equal(out, w.dequantize(dtype))


def test_prefill_rows_widen_into_one_growing_scratch():
    gen = torch.Generator().manual_seed(3)
    small, large = fp8_weight(gen, 16, 64, 32), fp8_weight(gen, 48, 64, 32)
    x = random_x(gen, 130, 64, dtype=torch.float32)
    for w in (small, large, small):
        assert rel_err(block_fp8_linear_triton(x, w), block_fp8_linear_ref(x, w)) < TOL[torch.float32]
    # One buffer a device and dtype: the smaller projection widens into the larger one's.
    assert (
        widened_scratch(small, torch.float32).data_ptr() == widened_scratch(large, torch.float32).data_ptr()
    )
    assert widened_bytes(torch.nn.ModuleList([small, large]), torch.bfloat16) == 48 * 64 * 2


def test_row_scales_follow_tiles_from_a_shard_start():
    tiles = torch.arange(6.0).view(3, 2)  # tile rows of 4 weight rows
    scales = row_scales(tiles, 4, first_row=6, rows=5)  # weight rows 6..10: tiles rows 1 (6, 7), 2 (8..10)
    assert scales[:, 0].tolist() == [0.0, 0.0, 2.0, 2.0, 2.0]


def test_reference_dequantizes_as_the_checkpoint_reader():
    """Column c of a row takes its row's scale (c + offset) // block: an offset of 3 into 4-column tiles."""
    w = BlockFP8Weight(1, 6, 4, offset=3)
    w.load_rows(slice(0, 1), torch.ones(1, 6).to(torch.float8_e4m3fn), torch.tensor([[2.0, 3.0, 5.0]]))
    assert w.dequantize(torch.float32).tolist() == [[2.0, 3.0, 3.0, 3.0, 3.0, 5.0]]


def test_bad_shapes_are_refused():
    w = BlockFP8Weight(8, 16, 16)
    with pytest.raises(ValueError, match="rows 0:8"):
        w.load_rows(slice(0, 8), torch.zeros(8, 16).to(torch.float8_e4m3fn), torch.zeros(8, 2))
    with pytest.raises(ValueError, match="offset"):
        BlockFP8Weight(8, 16, 16, offset=16)


def test_default_config_fills_the_multiprocessors():
    assert default_config(2112, 1, 128).block_n == 16  # DeepSeek-V3's q_a|kv_a: 132 programs of 16 rows
    assert default_config(24576, 1, 128).block_n == 64
    assert default_config(24576, 4096, 128).block_m == 64
    assert default_config(7168, 1, 64).block_k == 64


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("m", "n", "k"), [(1, 2112, 7168), (16, 7168, 2048), (300, 4096, 7168)])
@pytest.mark.parametrize("scales", ["own", "tiles", "interleaved"])
def test_deepseek_v3_shapes_on_the_gpu(m, n, k, scales):
    """DeepSeek-V3's q_a|kv_a at a decode row, the shared down at 16 rows and a 300-token prefill of the
    shared gate|up, with the default tiles, in bf16 against the fp32 product: scales of each row's own, of
    a checkpoint's 128-row tiles, and of tiles with gate and up rows interleaved."""
    gen = torch.Generator().manual_seed(n)
    w = (
        fp8_weight(gen, n, k, 128)
        if scales == "own"
        else shared_fp8_weight(gen, n, k, 128, scales == "interleaved")
    )
    x = random_x(gen, m, k, dtype=torch.bfloat16)
    assert rel_err(block_fp8_linear_triton(x, w), block_fp8_linear_ref(x.float(), w)) < 1e-2
