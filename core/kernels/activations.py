"""The MLP activation kernel of a decoder layer, beside its torch reference.

- :func:`silu_mul`: ``silu(gate) * up`` over a packed ``[T, 2I]`` gate|up output whose columns alternate
  gate 0, up 0, gate 1, ... (the weight layout of :func:`~pegainfer.kernels.skinny_gemm.interleave_gate_up`,
  which lets the decode GEMM apply it in its epilogue).

The kernels round where the torch reference rounds (every op of the reference returns the input dtype),
so in bf16 they match it to about one ulp rather than to bf16 noise.
"""

from __future__ import annotations

import torch

from pegainfer.kernels._triton import (
    as_rows,
    cast_to,
    interp_bf16,
    next_pow2,
    pdl_launch,
    pdl_start,
    tl,
    triton,
    use_kernel,
)
from pegainfer.layers import activation


@triton.jit
def _silu_mul_kernel(
    x_ptr,
    out_ptr,
    stride_x,
    stride_o,
    n_cols,
    BLOCK: tl.constexpr,
    FIX: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    # One contiguous load of the (gate, up) pairs, split in registers.
    pairs = 2 * cols[:, None] + tl.arange(0, 2)[None, :]
    g, u = tl.split(tl.load(x_ptr + row * stride_x + pairs, mask=mask[:, None], other=0.0))
    dtype = g.dtype
    g, u = g.to(tl.float32), u.to(tl.float32)
    s = cast_to(g / (1.0 + tl.exp(-g)), dtype, FIX).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, cast_to(s * u, dtype, FIX), mask=mask)


def silu_mul_triton(x: torch.Tensor, *, out: torch.Tensor | None = None, block: int = 1024) -> torch.Tensor:
    """The Triton path of :func:`silu_mul`."""
    if x.shape[-1] % 2:
        raise ValueError(f"silu_mul needs an even last dim (gate | up), got {x.shape[-1]}")
    n = x.shape[-1] // 2
    if out is None:
        out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    x2, o2 = as_rows(x), as_rows(out)
    if o2.data_ptr() != out.data_ptr():
        raise ValueError("out must have a contiguous last dimension")
    if x2.shape[0]:
        block = min(block, next_pow2(n))
        _silu_mul_kernel[(x2.shape[0], triton.cdiv(n, block))](
            x2, o2, x2.stride(0), o2.stride(0), n, BLOCK=block, FIX=interp_bf16(x.dtype), num_warps=4,
            **pdl_launch(x),
        )  # fmt: skip
    return out


def silu_mul_ref(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    y = activation.silu_mul(x)
    return y if out is None else out.copy_(y)


def silu_mul(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` of x ``[..., 2I]``, the packed gate_up GEMM output with gate and up columns
    alternating; returns ``[..., I]`` in x's dtype (into ``out`` when given)."""
    if use_kernel(x):
        return silu_mul_triton(x, out=out)
    return silu_mul_ref(x, out=out)
