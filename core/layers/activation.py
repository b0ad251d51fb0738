"""SwiGLU's activation in torch, the reference the Triton kernel and the fused decode GEMM match."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a packed ``[..., 2I]`` gate|up projection whose columns alternate gate 0,
    up 0, gate 1, ... (so a decode GEMM tile holds whole pairs and applies it in its epilogue)."""
    # silu over the whole contiguous row, then the gate columns picked: twice the silu work but on the CPU
    # 2x faster than silu over the stride-2 gate view, and rounded as transformers' silu of a
    # contiguous gate_proj output (the strided form differs by an ulp).
    return F.silu(gate_up)[..., 0::2] * gate_up[..., 1::2]


def interleave_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The rows of ``gate`` and ``up`` ``[I, K]`` alternated (gate 0, up 0, gate 1, ...): the packed weight
    whose output :func:`silu_mul` takes."""
    return torch.stack((gate, up), dim=1).reshape(2 * gate.shape[0], gate.shape[1])
