"""DeepSeek's block FP8 checkpoints on the reference path: weights are dequantized once, at load time.

A quantized projection ``X.weight`` is stored as float8_e4m3fn next to ``X.weight_scale_inv`` (float32,
one value per ``block`` = 128×128 tile, edge tiles partial); the real weight is their product with each
scale broadcast over its tile. Unquantized tensors (norms, router, embeddings) are read as they are.
"""

from __future__ import annotations

import torch

from pegainfer.errors import CheckpointError
from pegainfer.loader import CheckpointReader

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def dequantize_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float32 ``weight · scale_inv``, the scale of tile (i, j) applied to rows ``[i·bo, (i+1)·bo)`` and
    columns ``[j·bi, (j+1)·bi)``."""
    bo, bi = block
    out, inp = weight.shape
    expected = (-(-out // bo), -(-inp // bi))
    if tuple(scale_inv.shape) != expected:
        raise CheckpointError(
            f"weight_scale_inv has shape {tuple(scale_inv.shape)}, expected {expected} for a {out}×{inp} "
            f"weight in {bo}×{bi} blocks"
        )
    scale = scale_inv.float().repeat_interleave(bo, dim=0)[:out].repeat_interleave(bi, dim=1)[:, :inp]
    return weight.float() * scale


class WeightReader:
    """``get`` as CheckpointReader's, dequantizing tensors that come with a ``_scale_inv`` companion."""

    def __init__(self, reader: CheckpointReader, block: tuple[int, int] | None) -> None:
        self.reader = reader
        self.block = block

    def __contains__(self, name: str) -> bool:
        return name in self.reader

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        scale_name = name + "_scale_inv"
        if scale_name not in self.reader:
            tensor = self.reader.get(name, shape)
            if tensor.dtype in FP8_DTYPES:  # a bare cast would drop the block scales
                raise CheckpointError(f"tensor '{name}' is stored in FP8 without its '{scale_name}'")
            return tensor.to(dtype)
        if self.block is None:
            raise CheckpointError(
                f"tensor '{scale_name}' is in the checkpoint but config.json has no FP8 quantization_config"
            )
        weight = self.reader.get(name, shape)
        try:
            dense = dequantize_blocks(weight, self.reader.get(scale_name), self.block)
        except CheckpointError as exc:
            raise CheckpointError(f"tensor '{scale_name}': {exc}") from None
        return dense.to(dtype)
