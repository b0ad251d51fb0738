"""The skinny (decode) GEMM kernel vs its torch reference on fresh random inputs.

Both accumulate in fp32 but in different orders, so 16-bit outputs may differ by an ulp of the output
where the rounding is close; the bound is relative to the output scale. fp32 agrees to 1e-5.
"""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import DEVICE, rel_err

from pegainfer.kernels.activations import silu_mul_ref
from pegainfer.kernels.skinny_gemm import (
    DISPATCH_ROWS,
    MAX_ROWS,
    SkinnyConfig,
    _one_program_per_sm,
    default_config,
    skinny_linear,
    skinny_linear_ref,
    skinny_linear_triton,
)
from pegainfer.layers.activation import interleave_gate_up
from pegainfer.layers.norm import fold_rms_norm_weight

TOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}


def _rand(gen, *shape, dtype):
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    ("m", "n", "k", "config"),
    [
        (1, 64, 256, SkinnyConfig(32, 64)),
        (3, 70, 160, SkinnyConfig(32, 64)),  # ragged N and K: masked edges
        (16, 96, 128, SkinnyConfig(64, 32, num_stages=2)),
        (40, 48, 64, SkinnyConfig(16, 32)),  # a 64-row x tile
        (5, 33, 100, None),  # the default tiles, larger than the problem
    ],
    ids=["1x64x256", "3x70x160-ragged", "16x96x128", "40x48x64", "5x33x100-default"],
)
def test_matches_linear(dtype, m, n, k, config):
    gen = torch.Generator().manual_seed(m * n + k)
    x, w, bias = _rand(gen, m, k, dtype=dtype), _rand(gen, n, k, dtype=dtype), _rand(gen, n, dtype=dtype)
    ref = (x.double() @ w.double().T + bias.double()).to(dtype)
    got = skinny_linear_triton(x, w, bias, config=config)
    assert got.shape == (m, n) and got.dtype == dtype
    assert rel_err(got, ref) < TOL[dtype]
    assert rel_err(skinny_linear_triton(x, w, config=config), ref - bias) < TOL[dtype]


def test_leading_dims_and_too_many_rows():
    gen = torch.Generator().manual_seed(3)
    x, w = _rand(gen, 2, 3, 64, dtype=torch.float32), _rand(gen, 40, 64, dtype=torch.float32)
    got = skinny_linear_triton(x, w, config=SkinnyConfig(16, 32))
    assert got.shape == (2, 3, 40)
    assert rel_err(got, x @ w.T) < 1e-5
    with pytest.raises(ValueError, match="at most"):
        skinny_linear_triton(_rand(gen, MAX_ROWS + 1, 64, dtype=torch.float32), w)


def test_dispatch_takes_the_reference_off_cuda_and_for_many_rows():
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(24, 32, generator=gen)
    x = torch.randn(DISPATCH_ROWS + 4, 32, generator=gen)
    assert torch.equal(skinny_linear(x, w), torch.nn.functional.linear(x, w))


def _ulp_close(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal up to one rounding of the output dtype (compiled code may contract multiply-adds)."""
    tol = {torch.float32: 1e-6, torch.bfloat16: 2**-7, torch.float16: 2**-10}[got.dtype]
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)


FUSED_CASES = pytest.mark.parametrize(
    ("m", "n", "k", "config"),
    [(1, 64, 256, SkinnyConfig(32, 64)), (3, 70, 160, SkinnyConfig(32, 64)), (16, 96, 128, None)],
    ids=["1x64x256", "3x70x160-ragged", "16x96x128-default"],
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@FUSED_CASES
def test_norm_option_is_rms_norm_then_linear(dtype, m, n, k, config):
    """``norm_eps``: the un-normed rows in, the norm's weight folded into w; every row has its own scale."""
    gen = torch.Generator().manual_seed(m + n + k)
    x = (torch.randn(m, k, generator=gen) * torch.linspace(0.1, 8.0, m)[:, None]).to(dtype).to(DEVICE)
    w, norm_w = _rand(gen, n, k, dtype=dtype), _rand(gen, k, dtype=dtype)
    bias = _rand(gen, n, dtype=dtype)
    x64 = x.double()
    normed = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_w.double()
    ref = (normed @ w.double().T + bias.double()).to(dtype)
    folded = fold_rms_norm_weight(w, norm_w)
    got = skinny_linear_triton(x, folded, bias, config=config, norm_eps=1e-6)
    assert got.shape == (m, n)
    assert rel_err(got, ref) < TOL[dtype]
    assert rel_err(skinny_linear_ref(x, folded, bias, norm_eps=1e-6), ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@FUSED_CASES
def test_silu_option_equals_the_separate_activation(dtype, m, n, k, config):
    """``silu``: gate and up rows interleaved; the epilogue rounds as the GEMM then silu_mul would."""
    n += n % 2
    gen = torch.Generator().manual_seed(7 * m + n)
    x = _rand(gen, m, k, dtype=dtype)
    gate, up = _rand(gen, n // 2, k, dtype=dtype), _rand(gen, n // 2, k, dtype=dtype)
    w = interleave_gate_up(gate, up)
    assert torch.equal(w[0::2], gate) and torch.equal(w[1::2], up)
    got = skinny_linear_triton(x, w, config=config, silu=True)
    assert got.shape == (m, n // 2)
    _ulp_close(got, silu_mul_ref(skinny_linear_triton(x, w, config=config)))
    ref = torch.nn.functional.silu(x.double() @ gate.double().T) * (x.double() @ up.double().T)
    assert rel_err(got, ref.to(dtype)) < 2 * TOL[dtype]
    normed = skinny_linear_triton(x, w, config=config, norm_eps=1e-5, silu=True)
    assert rel_err(normed, skinny_linear_ref(x, w, norm_eps=1e-5, silu=True)) < 2 * TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@FUSED_CASES
def test_residual_option_adds_in_place(dtype, m, n, k, config):
    gen = torch.Generator().manual_seed(m * k + 1)
    x, w = _rand(gen, m, k, dtype=dtype), _rand(gen, n, k, dtype=dtype)
    residual = _rand(gen, m, n, dtype=dtype) * 4
    expected = residual + skinny_linear_triton(x, w, config=config)  # rounded as torch's add
    before = residual.clone()
    got = skinny_linear_triton(x, w, config=config, residual=residual)
    assert got.data_ptr() == residual.data_ptr()
    assert torch.equal(residual, expected)
    ref = skinny_linear_ref(x, w, residual=before)
    assert ref is before and rel_err(residual, ref) < TOL[dtype]


def test_fused_options_reject_what_they_cannot_do():
    gen = torch.Generator().manual_seed(5)
    x, w = _rand(gen, 2, 32, dtype=torch.float32), _rand(gen, 6, 32, dtype=torch.float32)
    with pytest.raises(ValueError, match="silu"):
        skinny_linear_triton(x, w, silu=True, residual=torch.zeros(2, 6, device=DEVICE))
    with pytest.raises(ValueError, match="silu"):
        skinny_linear_triton(x, w[:5], silu=True)
    with pytest.raises(ValueError, match="residual"):
        skinny_linear_triton(x, w, residual=torch.zeros(2, 5, device=DEVICE))


def test_early_launch_only_for_one_program_per_multiprocessor():
    """PDL for the 5120-wide projections' deep tiles, not for gate|up's or lm_head's smaller ones, whose
    early programs would pile onto the idle multiprocessors (docs/benchmarks.md, fifth run)."""
    x = torch.empty(1, 5120, dtype=torch.bfloat16)
    assert _one_program_per_sm(default_config(7168, 5120), 16, x)  # q|k|v, o_proj, down
    assert not _one_program_per_sm(default_config(34816, 5120), 16, x)  # gate|up
    assert not _one_program_per_sm(default_config(151936, 5120), 16, x)  # lm_head
