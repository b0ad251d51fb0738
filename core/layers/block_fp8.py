"""A projection's weight kept in block FP8 (W8A16), and the torch reference of its GEMM.

DeepSeek's FP8 checkpoints store ``X.weight`` as float8_e4m3fn with one float32 scale per 128 × 128
tile. :class:`BlockFP8Weight` keeps the float8 values and gives every *row* its tiles' scales along the
columns (``scale`` ``[N, tiles]``): a row order the tiles do not follow (gate and up rows interleaved,
two projections stacked, a tensor-parallel shard that starts inside a tile) stays expressible, for 4
bytes per row per 128 columns (3% of the float8 bytes). Only the columns may start inside a tile: column
``c`` of the weight takes its row's scale ``(c + offset) // block``.

The kernel (``pegainfer.kernels.block_fp8_gemm``) multiplies the float8 values (exact in bf16) and scales
each row's partial sum per tile; the reference dequantizes the whole weight first, exactly as the
checkpoint reader dequantizes at load (the fp32 product, then the model's dtype).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pegainfer.layers.activation import silu_mul


class BlockFP8Weight(nn.Module):
    """``weight`` float8_e4m3fn ``[N, K]`` and ``scale`` float32 ``[N, ceil((offset + K) / block)]``,
    uninitialised (filled by ``load_rows``) on the current default device."""

    def __init__(self, n: int, k: int, block: int, offset: int = 0) -> None:
        super().__init__()
        if not 0 <= offset < block:
            raise ValueError(f"a column offset must lie inside the first tile: 0 <= {offset} < {block}")
        self.block = block
        self.offset = offset
        tiles = -(-(offset + k) // block)
        self.weight = nn.Parameter(torch.empty(n, k, dtype=torch.float8_e4m3fn), requires_grad=False)
        self.scale = nn.Parameter(torch.empty(n, tiles, dtype=torch.float32), requires_grad=False)

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def load_rows(self, rows: slice, weight: torch.Tensor, scale: torch.Tensor) -> None:
        """Rows ``rows`` from float8 ``weight`` and their per-row tile scales ``scale`` (``[rows, tiles]``
        on this weight's column grid)."""
        target_w, target_s = self.weight[rows], self.scale[rows]
        if weight.shape != target_w.shape or scale.shape != target_s.shape or weight.dtype != target_w.dtype:
            raise ValueError(
                f"rows {rows.start}:{rows.stop} take a {tuple(target_w.shape)} float8 weight and "
                f"{tuple(target_s.shape)} scales, got {tuple(weight.shape)} {weight.dtype} and "
                f"{tuple(scale.shape)}"
            )
        with torch.no_grad():
            target_w.copy_(weight)
            target_s.copy_(scale)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight in ``dtype``: each element times its scale in fp32, then rounded once."""
        k = self.weight.shape[1]
        scale = self.scale.repeat_interleave(self.block, dim=1).narrow(1, self.offset, k)
        return (self.weight.float() * scale).to(dtype)


def widened_bytes(model: nn.Module, dtype: torch.dtype) -> int:
    """The scratch a prefill step of ``model`` widens its block-FP8 projections into on CUDA
    (``kernels.block_fp8_gemm.widened_scratch``): its largest one in ``dtype``; 0 without any."""
    sizes = [m.weight.numel() for m in model.modules() if isinstance(m, BlockFP8Weight)]
    return max(sizes, default=0) * torch.empty((), dtype=dtype).element_size()


def row_scales(tiles: torch.Tensor, block_rows: int, first_row: int, rows: int) -> torch.Tensor:
    """Per-row scales ``[rows, tiles]`` from tile scales ``tiles`` whose first tile row starts at weight
    row ``first_row - first_row % block_rows`` (tiles of ``block_rows`` rows)."""
    return tiles.repeat_interleave(block_rows, dim=0).narrow(0, first_row % block_rows, rows).contiguous()


def block_fp8_linear_ref(
    x: torch.Tensor,
    w: BlockFP8Weight,
    bias: torch.Tensor | None = None,
    *,
    silu: bool = False,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ w.T (+ bias)`` in ``x``'s dtype over the dequantized weight; ``silu``: the rows alternate
    gate, up and the result is ``silu(gate) * up``; ``residual``: returns ``residual + y``, a new tensor."""
    y = F.linear(x, w.dequantize(x.dtype), bias)
    if silu:
        return silu_mul(y)
    return y if residual is None else residual + y
