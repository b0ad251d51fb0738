"""SwiGLU's activation in torch, the reference the Triton kernel and the fused decode GEMM match."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a packed ``[..., 2I]`` gate|up projection whose columns alternate gate 0,
    up 0, gate 1, ... (so a decode GEMM tile holds whole pairs and applies it in its epilogue)."""
    gate, up = gate_up.unflatten(-1, (-1, 2)).unbind(-1)
    return F.silu(gate) * up


def interleave_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The rows of ``gate`` and ``up`` ``[I, K]`` alternated (gate 0, up 0, gate 1, ...): the packed weight
    whose output :func:`silu_mul` takes."""
    return torch.stack((gate, up), dim=1).reshape(2 * gate.shape[0], gate.shape[1])
