"""The dense projections of a Qwen3.5 layer, dispatched per device.

Decode-sized row counts on CUDA (``skinny_gemm.takes_kernel``) go through the skinny decode GEMM, which
streams the weight once, applies SiLU·mul of an interleaved gate|up in its epilogue and adds a row-parallel
output to the residual stream inside the GEMM (one rank): a decode layer has no separate activation or
residual-add launches. Any other batch (prefill, the CPU) runs the GEMM into its pass buffer, so a
forward's memory stays what the plan reserved, and the activation through ``pegainfer.kernels`` where
CUDA has the kernel (the torch reference elsewhere).
"""

from __future__ import annotations

import torch

from pegainfer import ops
from pegainfer.layers.activation import silu_mul
from pegainfer.parallel.distributed import TensorParallel


def _skinny(x: torch.Tensor) -> bool:
    if not ops.use_triton(x):
        return False
    from pegainfer.kernels import skinny_gemm

    return skinny_gemm.takes_kernel(x)


def project(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``x @ w.T``: the skinny kernel's new tensor for decode rows on CUDA, else into ``out``."""
    if _skinny(x):
        from pegainfer.kernels import skinny_gemm

        return skinny_gemm.skinny_linear_triton(x, w)
    return torch.matmul(x, w.t(), out=out)


def project_silu(x: torch.Tensor, w: torch.Tensor, gate_up: torch.Tensor, act: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``x @ w.T`` for an interleaved gate|up ``w`` (``interleave_gate_up``); else
    the GEMM's output in ``gate_up`` and the activation in ``act``."""
    if _skinny(x):
        from pegainfer.kernels import skinny_gemm

        return skinny_gemm.skinny_linear_triton(x, w, silu=True)
    gate_up = torch.matmul(x, w.t(), out=gate_up)
    if ops.use_triton(x):  # kernels are imported on CUDA only (see pegainfer.ops)
        from pegainfer.kernels import activations

        return activations.silu_mul_triton(gate_up, out=act)
    return act.copy_(silu_mul(gate_up))


def project_add(
    x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, out: torch.Tensor, tp: TensorParallel
) -> torch.Tensor:
    """``residual += all_reduce(x @ w.T)`` in place (a row-parallel projection added to the residual
    stream); ``out`` holds the projection where the GEMM is not the skinny kernel. Returns ``residual``."""
    if _skinny(x) and tp.group is None:
        from pegainfer.kernels import skinny_gemm

        return skinny_gemm.skinny_linear_triton(x, w, residual=residual)
    return residual.add_(tp.all_reduce(project(x, w, out)))
