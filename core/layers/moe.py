"""Routed experts in torch: the reference of the fused MoE kernels (``pegainfer.kernels.fused_moe``).

Experts are stacked: gate|up ``[E, 2I, H]`` (each expert's gate rows, then its up rows) and down
``[E, H, I]``. A token's output is ``Σ_k weights[t, k] · Expert_{ids[t, k]}(x[t])``.

Block-FP8 experts (DeepSeek's checkpoints) stay in float8 with :class:`BlockScales`: every weight tile of
``block`` (rows, columns) has one float32 scale, and an expert is dequantized only where it is used (here
for the experts that received tokens, in the kernels tile by tile). With ``fp8_activations`` (W8A8) each
expert's two GEMMs take their input quantized per token and weight tile too
(``layers.block_fp8.quantize_activations_ref``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pegainfer.layers.block_fp8 import dequantize_activations, quantize_activations_ref


@dataclass(frozen=True)
class BlockScales:
    """The float32 tile scales of stacked float8 experts: ``gate_up`` ``[E, 2, tiles_I, tiles_H]`` (the gate's,
    then the up's: each half is its own ``[I, H]`` matrix), ``down`` ``[E, tiles_H, tiles_I]``. ``block`` is
    a tile's (rows, columns); ``offset`` is where feature 0 of this rank's ``I`` sits in its first tile
    (a tensor-parallel shard need not start on a tile boundary); ``fp8_activations``: the GEMMs quantize
    their inputs per token and tile of columns (W8A8)."""

    gate_up: torch.Tensor
    down: torch.Tensor
    block: tuple[int, int]
    offset: int = 0
    fp8_activations: bool = False

    def __post_init__(self) -> None:
        # One offset serves the gate/up rows (tiles of block[0]) and down's columns (tiles of block[1]).
        if self.offset and self.block[0] != self.block[1]:
            raise ValueError(f"a shard offset ({self.offset}) needs square tiles, not {self.block}")

    def dequantize(
        self, expert: int, gate_up: torch.Tensor, down: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert ``expert``'s weights (``gate_up`` ``[2I, H]``, ``down`` ``[H, I]`` in float8) in ``dtype``."""
        bo, bi = self.block
        inter, hidden = down.shape[1], down.shape[0]
        rows = (torch.arange(inter, device=down.device) + self.offset) // bo  # I as the gate/up rows
        cols = torch.arange(hidden, device=down.device) // bi
        gu_scale = self.gate_up[expert][:, rows][:, :, cols].reshape(2 * inter, hidden)
        d_rows = torch.arange(hidden, device=down.device) // bo
        d_cols = (torch.arange(inter, device=down.device) + self.offset) // bi  # I as down's columns
        d_scale = self.down[expert][d_rows][:, d_cols]
        return (gate_up.float() * gu_scale).to(dtype), (down.float() * d_scale).to(dtype)


def swiglu(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    limit: float | None = None,
    linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear,
) -> torch.Tensor:
    """``down(silu(gate(x)) * up(x))``; with ``limit`` (DeepSeek-V4) gate is capped at it and up clamped
    to ``[-limit, limit]`` first. ``linear`` runs both projections (a model passes ``ops.linear`` for the
    decode-sized GEMM kernel on CUDA; this module sits below ``ops`` and cannot import it)."""
    gate, up = linear(x, gate_up).chunk(2, dim=-1)
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return linear(F.silu(gate) * up, down)


def routed_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    limit: float | None = None,
    scales: BlockScales | None = None,
) -> torch.Tensor:
    """``Σ_k weights[:, k] · Expert_{ids[:, k]}(x)`` over stacked experts (gate|up ``[E, 2I, H]``, down
    ``[E, H, I]``; float8 with ``scales``): a reference loop over the experts that received tokens, in
    expert order."""
    out = torch.zeros_like(x)
    k = ids.shape[1]
    flat_ids, flat_weights = ids.flatten(), weights.flatten()
    token_of = torch.arange(x.shape[0], device=x.device).repeat_interleave(k)
    for expert in torch.unique(flat_ids).tolist():
        picks = (flat_ids == expert).nonzero().squeeze(1)
        tokens = token_of[picks]
        w_gate_up, w_down = gate_up[expert], down[expert]
        if scales is not None and scales.fp8_activations:
            if limit is not None:
                raise ValueError("W8A8 experts take no SwiGLU limit (DeepSeek-V4's clamp)")
            y = _swiglu_w8a8(x[tokens], *scales.dequantize(expert, w_gate_up, w_down, torch.float32), scales)
        else:
            if scales is not None:
                w_gate_up, w_down = scales.dequantize(expert, w_gate_up, w_down, x.dtype)
            y = swiglu(x[tokens], w_gate_up, w_down, limit)
        out.index_add_(0, tokens, (y * flat_weights[picks, None]).to(out.dtype))
    return out


def _swiglu_w8a8(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, scales: BlockScales
) -> torch.Tensor:
    """``swiglu`` with both GEMMs W8A8 (fp32 weights ``gate_up``, ``down`` dequantized): ``x`` quantized on
    H's tiles, ``silu(gate) * up`` on I's (from the shard's ``offset``); each product in fp32. As in the
    kernels, gate and up stay fp32 and the activation is rounded once to ``x``'s dtype before it is
    quantized (a rounding step on either side could move it across a float8 rounding boundary)."""
    group = scales.block[1]

    def linear(a: torch.Tensor, w: torch.Tensor, offset: int) -> torch.Tensor:
        q, s = quantize_activations_ref(a, group, offset)
        return F.linear(dequantize_activations(q, s, group, offset), w)

    gate, up = linear(x, gate_up, 0).chunk(2, dim=-1)
    return linear((F.silu(gate) * up).to(x.dtype), down, scales.offset).to(x.dtype)


def combine_routed(
    routed: torch.Tensor, add: torch.Tensor | None = None, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """``routed + add`` (the shared experts' output), added into ``residual`` in place and returned where
    given: the torch sequence of the kernels' last launch."""
    if add is not None:
        routed = routed + add
    return routed if residual is None else residual.add_(routed)
