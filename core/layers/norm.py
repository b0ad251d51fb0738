"""RMSNorm in the plain form (Qwen3, DeepSeek): normalise in fp32, cast back, then scale; the
zero-centred form (Qwen3.5, Gemma): the scale is ``1 + w``, applied in fp32 before the one cast; and the
gated form of linear-attention outputs (Qwen3.5, Qwen3-Next): per head, the plain form times ``silu(z)``."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``weight * (x / rms(x)).to(x.dtype)``, the order transformers uses (the cast comes before the scale);
    without ``weight`` (folded into the next projection) the unscaled ``(x / rms(x)).to(x.dtype)``."""
    x32 = x.float()
    y = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y if weight is None else weight * y


def rms_norm_zero_centred(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``(x32 / rms(x32) * (1 + w32)).to(x.dtype)``, transformers' order for the zero-centred weight."""
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())
    return y.to(x.dtype)


def rms_norm_gated(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``((w * (x32 / rms(x32)).to(dtype)) * silu(z32)).to(dtype)`` over each head of ``weight.numel()``
    columns of ``x`` (transformers' order for the gated norm); ``z`` has ``x``'s elements."""
    x32 = x.float().unflatten(-1, (-1, weight.numel()))
    y = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (y.float() * F.silu(z.reshape(x32.shape).float())).to(x.dtype).flatten(-2)


def fold_rms_norm_weight(w: torch.Tensor, norm_weight: torch.Tensor) -> torch.Tensor:
    """``w`` with the preceding RMSNorm's weight multiplied into its columns (in fp32, rounded once): then
    ``rms_norm(x, norm_weight) @ w.T`` is ``rms_norm(x, None) @ fold.T``, and the decode GEMM can apply
    the norm as one scale per output row. ``norm_weight`` may still be on the host (as the checkpoint
    reader returns it)."""
    return (w.float() * norm_weight.to(w.device, torch.float32)).to(w.dtype)
