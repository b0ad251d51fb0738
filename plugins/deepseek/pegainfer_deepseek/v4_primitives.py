"""DeepSeek-V4's norms and its rope on the trailing channels of a head.

V4 keeps norm weights in float32 and scales before the cast back (V3 casts first), and it has weightless
norms. Its rope rotates interleaved pairs of the *last* ``rope_dim`` channels; attention outputs are
rotated back (by minus the angle) at the query position, because values carry the keys' rope.
"""

from __future__ import annotations

import torch

from pegainfer.layers.rotary_yarn import default_inv_freq, yarn_inv_freq
from pegainfer_deepseek.v4_config import V4Rope


def scaled_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``(w · x32/rms(x32)).to(x.dtype)``: normalised and scaled in float32, cast once at the end."""
    x32 = x.float()
    return (weight.float() * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


def unit_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """The weightless norm: ``x · rsqrt(mean(x32²) + eps)``, the factor cast to x's dtype first."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class TrailingRope(torch.nn.Module):
    """Interleaved rope of the last ``rope_dim`` channels of ``x [T, ..., D]`` at ``positions [T]``.

    Angles are computed per call, as transformers does: a table over V4's million-token context would
    cost more memory than the model's caches on a CPU test."""

    def __init__(self, rope: V4Rope, rope_dim: int) -> None:
        super().__init__()
        if rope.yarn is None:
            inv_freq, self.factor = default_inv_freq(rope_dim, rope.theta), 1.0
        else:
            inv_freq, self.factor = yarn_inv_freq(rope_dim, rope.theta, rope.yarn), rope.yarn.cos_sin_factor()
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.rope_dim = rope_dim

    def forward(self, x: torch.Tensor, positions: torch.Tensor, *, inverse: bool = False) -> torch.Tensor:
        angles = positions.float()[:, None] * self.inv_freq
        cos = (angles.cos() * self.factor).to(x.dtype)
        sin = (angles.sin() * self.factor).to(x.dtype)
        if inverse:
            sin = -sin
        shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (-1,)
        cos, sin = cos.view(shape).float(), sin.view(shape).float()
        pairs = x[..., -self.rope_dim :].float().unflatten(-1, (-1, 2))
        a, b = pairs[..., 0], pairs[..., 1]
        rotated = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
        return torch.cat([x[..., : -self.rope_dim], rotated.to(x.dtype)], dim=-1)
