"""Rotary embedding with YaRN frequency scaling, in either pairing: interleaved (2i, 2i+1) or half-split.

DeepSeek MLA rotates its decoupled rope channels in interleaved pairs (complex multiplication). The
output keeps the input's channel order, so q and k must be rotated by the same instance; a dot product
is then identical to transformers', which de-interleaves both sides.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 · mscale · ln(factor) + 1`` (1 for an unstretched context)."""
    if factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class YarnScaling:
    """The ``rope_scaling`` / ``rope_parameters`` keys of a ``yarn`` rope."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    @classmethod
    def from_params(
        cls, params: dict[str, Any], max_position_embeddings: int, attention_factor: float | None
    ) -> YarnScaling:
        """From a config's rope keys with a ``factor`` (the caller checks the rope type and the factor);
        ``max_position_embeddings`` stands in for a missing ``original_max_position_embeddings``."""
        return cls(
            factor=float(params["factor"]),
            original_max_position_embeddings=int(
                params.get("original_max_position_embeddings") or max_position_embeddings
            ),
            beta_fast=float(params.get("beta_fast") or 32),
            beta_slow=float(params.get("beta_slow") or 1),
            mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"),
            attention_factor=attention_factor,
            truncate=bool(params.get("truncate", True)),
        )

    def cos_sin_factor(self) -> float:
        """The factor cos and sin are multiplied by (``attention_factor`` unless given explicitly)."""
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    def softmax_scale_factor(self) -> float:
        """The multiplier of the attention softmax scale: ``mscale(factor, mscale_all_dim)²`` (DeepSeek)."""
        if not self.mscale_all_dim:
            return 1.0
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2


def default_inv_freq(dim: int, theta: float) -> torch.Tensor:
    """``θ^(−2i/d)`` for i in [0, d/2)."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def yarn_inv_freq(dim: int, theta: float, yarn: YarnScaling) -> torch.Tensor:
    """YaRN: high frequencies kept (extrapolated), low ones divided by ``factor`` (interpolated), with a
    linear ramp between the correction dims found for ``beta_fast`` and ``beta_slow`` rotations."""

    def correction_dim(rotations: float) -> float:
        wavelength_ratio = yarn.original_max_position_embeddings / (rotations * 2 * math.pi)
        return dim * math.log(wavelength_ratio) / (2 * math.log(theta))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolated = default_inv_freq(dim, theta)
    interpolated = extrapolated / yarn.factor
    return interpolated * ramp + extrapolated * (1 - ramp)


class PairedRotaryEmbedding(torch.nn.Module):
    """cos/sin tables up to ``max_positions`` for ``inv_freq`` (``[d/2]``), scaled by ``cos_sin_factor``.

    ``interleaved=True`` rotates pairs (2i, 2i+1) by ``inv_freq[i]``; False rotates pairs (i, i + d/2).
    ``forward`` rotates the whole last dimension of q and k (pass just the rope channels).
    """

    def __init__(
        self,
        inv_freq: torch.Tensor,
        max_positions: int,
        *,
        cos_sin_factor: float = 1.0,
        interleaved: bool = True,
    ) -> None:
        super().__init__()
        self.interleaved = interleaved
        self.rotary_dim = 2 * inv_freq.numel()
        angles = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq.float()[None, :]
        self.register_buffer("cos", angles.cos() * cos_sin_factor, persistent=False)  # [P, d/2]
        self.register_buffer("sin", angles.sin() * cos_sin_factor, persistent=False)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.interleaved:
            pairs = x.unflatten(-1, (-1, 2))
            a, b = pairs[..., 0], pairs[..., 1]
            return torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
        a, b = x.chunk(2, dim=-1)
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q ``[T, heads, d]``, k ``[T, kv_heads, d]``, positions ``[T]``; rotated copies in q's dtype."""
        cos = self.cos[positions].to(q.dtype)[:, None, :]
        sin = self.sin[positions].to(q.dtype)[:, None, :]
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)
