"""The dense projections of a Qwen3.5 layer, dispatched per device.

Decode-sized row counts on CUDA (``skinny_gemm.takes_kernel``) go through the skinny decode GEMM, which
streams the weight once, applies SiLU·mul of an interleaved gate|up in its epilogue and adds a row-parallel
output to the residual stream inside the GEMM (one rank): a decode layer has no separate activation or
residual-add launches. Any other batch (prefill, the CPU) runs the GEMM into its pass buffer, so a
forward's memory stays what the plan reserved, and the activation through ``pegainfer.kernels`` where
CUDA has the kernel (the torch reference elsewhere).

A layer's RMSNorm before its first projection is folded: its ``(1 + w)`` is multiplied into that
projection's columns at load (``fold_norm``), and the projection takes the un-normed rows with a
:class:`FoldedNorm`: the skinny kernel scales each output row by the row's ``1 / rms`` (no norm launch);
elsewhere the plain norm is written into the pass buffer first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pegainfer import ops
from pegainfer.layers.activation import silu_mul
from pegainfer.layers.norm import fold_rms_norm_weight
from pegainfer.parallel.distributed import TensorParallel

if TYPE_CHECKING:  # the kernels are imported on CUDA only (see pegainfer.ops)
    from pegainfer.kernels.skinny_gemm import GatedNorm


@dataclass(frozen=True)
class FoldedNorm:
    """The rows given to a projection are un-normed; its weight carries the norm's scale (``fold_norm``).
    ``normed`` is the pass buffer the plain norm is written into where the GEMM cannot apply it."""

    eps: float
    normed: torch.Tensor


def fold_norm(w: torch.Tensor, zero_centred_weight: torch.Tensor) -> torch.Tensor:
    """``w`` with a zero-centred norm's ``1 + weight`` multiplied into its columns (fp32, rounded once)."""
    return fold_rms_norm_weight(w, 1.0 + zero_centred_weight.float())


def _normed(x: torch.Tensor, norm: FoldedNorm) -> torch.Tensor:
    return ops.rms_norm(x, None, norm.eps, out=norm.normed[: x.shape[0]])


def _skinny(x: torch.Tensor) -> bool:
    if not ops.use_triton(x):
        return False
    from pegainfer.kernels import skinny_gemm

    return skinny_gemm.takes_kernel(x)


def project(
    x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, norm: FoldedNorm | None = None
) -> torch.Tensor:
    """``x @ w.T`` (of ``x``'s plain RMSNorm with ``norm``): the skinny kernel's new tensor for decode rows
    on CUDA, else into ``out``."""
    if _skinny(x):
        from pegainfer.kernels import skinny_gemm

        return skinny_gemm.skinny_linear_triton(x, w, norm_eps=norm.eps if norm else None)
    if norm is not None:
        x = _normed(x, norm)
    return torch.matmul(x, w.t(), out=out)


def project_silu(
    x: torch.Tensor,
    w: torch.Tensor,
    gate_up: torch.Tensor,
    act: torch.Tensor,
    norm: FoldedNorm | None = None,
) -> torch.Tensor:
    """``silu(gate) * up`` of ``x @ w.T`` for an interleaved gate|up ``w`` (``interleave_gate_up``); else
    the GEMM's output in ``gate_up`` and the activation in ``act``. ``norm``: as for :func:`project`."""
    if _skinny(x):
        from pegainfer.kernels import skinny_gemm

        return skinny_gemm.skinny_linear_triton(x, w, silu=True, norm_eps=norm.eps if norm else None)
    if norm is not None:
        x = _normed(x, norm)
    gate_up = torch.matmul(x, w.t(), out=gate_up)
    if ops.use_triton(x):  # kernels are imported on CUDA only (see pegainfer.ops)
        from pegainfer.kernels import activations

        return activations.silu_mul_triton(gate_up, out=act)
    return act.copy_(silu_mul(gate_up))


def takes_gated_norm(x: torch.Tensor, w: torch.Tensor, tp: TensorParallel) -> bool:
    """Whether :func:`project_add` of ``x`` can apply a gated norm to it first (the single-row GEMV that
    holds its weights before the wait, ``skinny_gemm.takes_preload``, on one rank)."""
    if not (_skinny(x) and tp.group is None):
        return False
    from pegainfer.kernels import skinny_gemm

    return skinny_gemm.takes_preload(x, w)


def project_add(
    x: torch.Tensor,
    w: torch.Tensor,
    residual: torch.Tensor,
    out: torch.Tensor,
    tp: TensorParallel,
    gated: GatedNorm | None = None,
) -> torch.Tensor:
    """``residual += all_reduce(x @ w.T)`` in place (a row-parallel projection added to the residual
    stream); ``out`` holds the projection where the GEMM is not the skinny kernel. Returns ``residual``.
    ``gated`` (only where :func:`takes_gated_norm`): the GEMM of x's gated norm
    (``skinny_gemm.GatedNorm``)."""
    if _skinny(x) and tp.group is None:
        from pegainfer.kernels import skinny_gemm

        return skinny_gemm.skinny_linear_triton(x, w, residual=residual, gated=gated)
    if gated is not None:
        raise ValueError("project_add: a gated norm runs only inside the single-row GEMV (takes_gated_norm)")
    return residual.add_(tp.all_reduce(project(x, w, out)))
