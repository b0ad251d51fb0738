"""Parameter allocation shared by the DeepSeek modules: inference-only tensors filled by ``load``."""

from __future__ import annotations

import torch
from torch import nn

from pegainfer.layers.block_fp8 import BlockFP8Weight


def param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    """An uninitialised, non-trainable parameter on the current default device."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def projection(
    n: int,
    k: int,
    dtype: torch.dtype,
    fp8_block: tuple[int, int] | None,
    offset: int = 0,
    fp8_activations: bool = False,
) -> nn.Parameter | BlockFP8Weight:
    """A projection's ``[n, k]`` weight: block FP8 on ``fp8_block``'s columns (``offset``: where column 0
    sits in its first tile; ``fp8_activations``: W8A8) when the model keeps FP8 weights, else a parameter
    in ``dtype``. Filled by ``fp8.load_projection``; ``ops.linear`` takes either."""
    if fp8_block is None:
        return param(n, k, dtype=dtype)
    return BlockFP8Weight(n, k, fp8_block[1], offset, fp8_activations)
