"""Rotary position embedding, half-split pairs (i, i + d/2), optionally over the first ``rotary_dim`` channels."""

from __future__ import annotations

import torch

from pegainfer.errors import CheckpointError


def rope_parameters(hf_config: dict) -> tuple[float, str]:
    """(theta, rope_type) from either config layout: ``rope_parameters`` (transformers >= 5) or the legacy
    top-level ``rope_theta`` + ``rope_scaling``."""
    params = hf_config.get("rope_parameters") or {}
    scaling = hf_config.get("rope_scaling") or {}
    theta = params.get("rope_theta", hf_config.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    return float(theta), rope_type


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin tables up to ``max_positions``; ``forward`` rotates q and k at ``positions``."""

    def __init__(self, rotary_dim: int, theta: float, max_positions: int, rope_type: str = "default") -> None:
        super().__init__()
        if rope_type != "default":
            raise CheckpointError(f"rope_type '{rope_type}' is not supported by this model (only 'default')")
        self.rotary_dim = rotary_dim
        inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        angles = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat([-x[..., half:], x[..., :half]], dim=-1)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        d = self.rotary_dim
        if d == x.shape[-1]:
            return x * cos + self._rotate_half(x) * sin
        rot, rest = x[..., :d], x[..., d:]
        return torch.cat([rot * cos + self._rotate_half(rot) * sin, rest], dim=-1)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, heads, D], k: [T, kv_heads, D], positions: [T]; returns rotated copies in q's dtype."""
        cos = self.cos[positions].to(q.dtype)[:, None, :]
        sin = self.sin[positions].to(q.dtype)[:, None, :]
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)
