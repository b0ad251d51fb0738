"""RMSNorm kernels of a decoder layer, each beside its torch reference.

- :func:`rms_norm` over the last dim;
- :func:`fused_add_rms_norm`: residual add + norm, the residual updated in place.

The kernels round where the torch reference rounds (every op of the reference returns the input dtype),
so in bf16 they match it to about one ulp rather than to bf16 noise. A program reads its whole row
before writing it, so outputs may alias inputs where a docstring says so.
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
    warps_for,
)
from pegainfer.layers.norm import rms_norm as rms_norm_ref


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    stride_x,
    stride_r,
    stride_o,
    n_cols,
    eps,
    BLOCK: tl.constexpr,
    HAS_RES: tl.constexpr,
    HAS_W: tl.constexpr,
    FIX: tl.constexpr,
    FIX_OUT: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    dtype = x.dtype
    x = x.to(tl.float32)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        s = cast_to(x + r, dtype, FIX)
        tl.store(res_ptr + row * stride_r + cols, s, mask=mask)
        x = s.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 0) / n_cols + eps)
    y = cast_to(x * rstd, dtype, FIX).to(tl.float32)
    if HAS_W:
        y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, cast_to(y, out_ptr.dtype.element_ty, FIX_OUT), mask=mask)


def _rms_norm_launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None, eps: float, out: torch.Tensor
) -> None:
    n = x.shape[-1]
    if n > 65536:
        raise ValueError(f"rms_norm kernel handles rows of at most 65536 elements, got {n}")
    x2, o2 = as_rows(x), as_rows(out)
    r2 = as_rows(residual) if residual is not None else x2
    if residual is not None and r2.data_ptr() != residual.data_ptr():
        raise ValueError(
            "residual must be a tensor with a contiguous last dimension (it is updated in place)"
        )
    if o2.data_ptr() != out.data_ptr() or (out.stride(-1) != 1):
        raise ValueError("out must have a contiguous last dimension")
    if x2.shape[0] == 0:
        return
    _rms_norm_kernel[(x2.shape[0],)](
        x2,
        r2,
        x2 if weight is None else weight,
        o2,
        x2.stride(0),
        r2.stride(0),
        o2.stride(0),
        n,
        eps,
        BLOCK=next_pow2(n),
        HAS_RES=residual is not None,
        HAS_W=weight is not None,
        FIX=interp_bf16(x.dtype),
        FIX_OUT=interp_bf16(out.dtype),
        num_warps=warps_for(n),
        **pdl_launch(x),
    )


def _out_dtype(x: torch.Tensor, weight: torch.Tensor | None) -> torch.dtype:
    return x.dtype if weight is None else torch.promote_types(x.dtype, weight.dtype)


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The Triton path of :func:`rms_norm`."""
    if out is None:
        out = torch.empty(x.shape, dtype=_out_dtype(x, weight), device=x.device)
    _rms_norm_launch(x, None, weight, eps, out)
    return out


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """:func:`pegainfer.layers.norm.rms_norm` over the last dim of x ``[..., N]`` (fp32 statistics, cast
    to x's dtype, then times ``weight [N]`` unless it is None); the result has the promoted dtype of x and weight and is
    written into ``out`` when given (``out`` may be ``x``)."""
    if use_kernel(x):
        return rms_norm_triton(x, weight, eps, out=out)
    y = rms_norm_ref(x, weight, eps)
    return y if out is None else out.copy_(y)


def fused_add_rms_norm_triton(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    *,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton path of :func:`fused_add_rms_norm`."""
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}"
        )
    if out is None:
        out = torch.empty(x.shape, dtype=_out_dtype(x, weight), device=x.device)
    _rms_norm_launch(x, residual, weight, eps, out)
    return out, residual


def fused_add_rms_norm_ref(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    *,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    residual.copy_(residual + x)
    y = rms_norm_ref(residual, weight, eps)
    return (y if out is None else out.copy_(y)), residual


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    *,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual += x`` (rounded to the dtype, as torch's add), then ``rms_norm(residual)``; returns
    ``(normed, residual)``. x and residual share shape ``[..., N]`` and dtype; ``residual`` is updated in
    place; ``out`` (default: a new tensor) may be ``x``, so a layer's attention or MLP output buffer can
    hold the next normed input."""
    if use_kernel(x):
        return fused_add_rms_norm_triton(x, residual, weight, eps, out=out)
    return fused_add_rms_norm_ref(x, residual, weight, eps, out=out)
