"""Routed experts in torch: the reference of the fused MoE kernels (``pegainfer.kernels.fused_moe``).

Experts are stacked: gate|up ``[E, 2I, H]`` (each expert's gate rows, then its up rows) and down
``[E, H, I]``. A token's output is ``Σ_k weights[t, k] · Expert_{ids[t, k]}(x[t])``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, limit: float | None = None
) -> torch.Tensor:
    """``down(silu(gate(x)) * up(x))``; with ``limit`` (DeepSeek-V4) gate is capped at it and up clamped
    to ``[-limit, limit]`` first."""
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return F.linear(F.silu(gate) * up, down)


def routed_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    limit: float | None = None,
) -> torch.Tensor:
    """``Σ_k weights[:, k] · Expert_{ids[:, k]}(x)`` over stacked experts (gate|up ``[E, 2I, H]``, down
    ``[E, H, I]``): a reference loop over the experts that received tokens, in expert order."""
    out = torch.zeros_like(x)
    k = ids.shape[1]
    flat_ids, flat_weights = ids.flatten(), weights.flatten()
    token_of = torch.arange(x.shape[0], device=x.device).repeat_interleave(k)
    for expert in torch.unique(flat_ids).tolist():
        picks = (flat_ids == expert).nonzero().squeeze(1)
        tokens = token_of[picks]
        y = swiglu(x[tokens], gate_up[expert], down[expert], limit)
        out.index_add_(0, tokens, (y * flat_weights[picks, None]).to(out.dtype))
    return out
