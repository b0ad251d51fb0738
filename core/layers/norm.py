"""RMSNorm in the plain form (Qwen3, DeepSeek): normalise in fp32, cast back, then scale."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / rms(x)).to(x.dtype)``, the order transformers uses (the cast comes before the scale)."""
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)
