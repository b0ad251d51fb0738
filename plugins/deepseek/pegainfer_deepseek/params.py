"""Parameter allocation shared by the DeepSeek modules: inference-only tensors filled by ``load``."""

from __future__ import annotations

import torch
from torch import nn


def param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    """An uninitialised, non-trainable parameter on the current default device."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
