"""The skinny (decode) GEMM kernel vs its torch reference on fresh random inputs.

Both accumulate in fp32 but in different orders, so 16-bit outputs may differ by an ulp of the output
where the rounding is close; the bound is relative to the output scale. fp32 agrees to 1e-5.
"""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import DEVICE, rel_err

from pegainfer.kernels.skinny_gemm import (
    DISPATCH_ROWS,
    MAX_ROWS,
    SkinnyConfig,
    skinny_linear,
    skinny_linear_triton,
)

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
