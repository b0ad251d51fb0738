"""The two RMSNorms of Qwen3.5, each in transformers' exact cast order.

- zero-centred ``(1 + w)``: the layer norms, the final norm and the attention q/k norms. The multiply
  happens in fp32 and the cast comes last. Loading these weights as a plain scale nearly zeroes every
  activation.
- gated (the GDN output norm): a plain norm with weight around 1, then ``* silu(z)``.
"""

from __future__ import annotations

import torch

from pegainfer.layers.norm import rms_norm_gated
from pegainfer.layers.norm import rms_norm_zero_centred as zero_centred_ref
from pegainfer.ops import use_triton


def rms_norm_zero_centred(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``(norm(x32) * (1 + w32)).to(x.dtype)``, written into ``out`` when given. On CUDA one Triton
    launch (``gdn_kernels.rms_norm_zero_centred``) instead of the reference's chain of elementwise ops."""
    if use_triton(x) and x.dim() in (2, 3) and x.stride(-1) == 1 and (out is None or out.dtype == x.dtype):
        from pegainfer_qwen35 import gdn_kernels

        return gdn_kernels.rms_norm_zero_centred(x, weight, eps, out)
    return rms_norm_zero_centred_ref(x, weight, eps, out)


def rms_norm_zero_centred_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The torch reference of :func:`rms_norm_zero_centred` (core's, written into ``out`` when given)."""
    y = zero_centred_ref(x, weight, eps)
    return y if out is None else out.copy_(y)


def gated_rms_norm(
    x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``((w * norm(x32).to(dtype)) * silu(z32)).to(dtype)`` over the last dim (one value head): core's
    ``rms_norm_gated``, written into ``out`` when given."""
    y = rms_norm_gated(x, z, weight, eps)
    return y if out is None else out.copy_(y)
