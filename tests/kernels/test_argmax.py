"""The two-launch argmax (``kernels.argmax``) against ``torch.argmax``: first index of the maximum, NaN
first, rows of ``-inf``, chunk boundaries."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import DEVICE

from pegainfer.kernels import argmax as argmax_kernels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rows,n", [(1, 5000), (3, 2049), (2, 1), (6, 300)], ids=str)
def test_argmax_matches_torch(dtype, rows, n):
    gen = torch.Generator().manual_seed(rows * 7919 + n)
    x = torch.randn(rows, n, generator=gen).to(dtype).to(DEVICE)
    assert torch.equal(argmax_kernels.argmax(x), x.argmax(-1))


def test_argmax_ties_nan_and_all_minus_inf_rows_follow_torch():
    n = 3 * argmax_kernels.BLOCK + 5  # several chunks and a ragged tail on one row
    x = torch.zeros(5, n)
    x[0, [1500, n - 1]] = 1.0  # a tie across chunks: the first index
    x[1] = float("-inf")  # nothing but -inf: index 0
    x[2, [2500, 2700]] = float("nan")  # NaN beats everything, the first one wins
    x[2, 10] = float("inf")
    x[3, n - 1] = float("inf")  # the very last element
    x[4, :] = -1.0
    x[4, argmax_kernels.BLOCK] = -0.5  # the first element of a later block
    x = x.to(DEVICE)
    assert (
        argmax_kernels.argmax(x).tolist()
        == x.argmax(-1).tolist()
        == [1500, 0, 2500, n - 1, argmax_kernels.BLOCK]
    )


def test_argmax_writes_into_out_and_checks_it():
    x = torch.randn(4, 700).to(DEVICE)
    out = torch.full((4,), -1, dtype=torch.int64, device=DEVICE)
    assert argmax_kernels.argmax(x, out=out) is out
    assert torch.equal(out, x.argmax(-1))
    with pytest.raises(ValueError, match="int64"):
        argmax_kernels.argmax(x, out=out.to(torch.int32))
    with pytest.raises(ValueError, match="contiguous last dim"):
        argmax_kernels.argmax(x.t())


def test_chunks_fill_the_gpu_without_exceeding_the_row():
    assert argmax_kernels.argmax_chunks(1, 129280, 132) == 127  # 264 wanted, 127 blocks in the row
    assert argmax_kernels.argmax_chunks(64, 248320, 132) == 5
    assert argmax_kernels.argmax_chunks(1, 10, 132) == 1
