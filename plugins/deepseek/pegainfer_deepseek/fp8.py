"""DeepSeek's block FP8 checkpoints: the routed experts stay float8 with their tile scales (``get_blocks``;
``moe.MoE``), the projections of attention and of the dense and shared feed-forwards stay float8 with
per-row tile scales (``load_projection``; ``pegainfer.layers.block_fp8``); the rest (``kv_b_proj``, the
V3.2 indexer's, MTP's ``eh_proj``) is dequantized once, at load time. ``quantize_blocks`` makes the same
format from plain weights (``model.quantization=fp8``, and the tiny FP8 test checkpoints).

A quantized projection ``X.weight`` is stored as float8_e4m3fn next to ``X.weight_scale_inv`` (float32,
one value per ``block`` = 128×128 tile, edge tiles partial); the real weight is their product with each
scale broadcast over its tile. Unquantized tensors (norms, router, embeddings) are read as they are.

Under tensor parallelism a tensor read with a shard rule (``pegainfer.parallel.sharding``) is read as the rank's
slices only; for a quantized one, so are the rows (or columns) of ``weight_scale_inv`` whose tiles cover
those slices. A slice need not start on a tile boundary (small checkpoints, or a block larger than a
rank's share): the first tile's scale is then applied from an offset into it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pegainfer.errors import CheckpointError
from pegainfer.layers.block_fp8 import FP8_MAX, BlockFP8Weight, row_scales
from pegainfer.model.checkpoint import CheckpointReader
from pegainfer.parallel.sharding import Shard

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def dequantize_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float32 ``weight · scale_inv``, the scale of tile (i, j) applied to rows ``[i·bo, (i+1)·bo)`` and
    columns ``[j·bi, (j+1)·bi)``."""
    bo, bi = block
    out, inp = weight.shape
    expected = _scale_shape((out, inp), block)
    if tuple(scale_inv.shape) != expected:
        raise CheckpointError(_scale_shape_error(tuple(scale_inv.shape), (out, inp), block))
    scale = scale_inv.float().repeat_interleave(bo, dim=0)[:out].repeat_interleave(bi, dim=1)[:, :inp]
    return weight.float() * scale


def quantize_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(float8_e4m3fn weight, float32 scale_inv [ceil(out/bo), ceil(in/bi)])``; a block's largest magnitude
    maps to 448. Edge blocks are partial (as if zero-padded to the full block)."""
    bo, bi = block
    out, inp = weight.shape
    nbo, nbi = -(-out // bo), -(-inp // bi)
    padded = torch.zeros(nbo * bo, nbi * bi, dtype=torch.float32)
    padded[:out, :inp] = weight.float()
    blocks = padded.view(nbo, bo, nbi, bi)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale_inv = amax / FP8_MAX
    q = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(nbo * bo, nbi * bi)[:out, :inp].contiguous(), scale_inv.contiguous()


def quantize_from(
    plain: torch.Tensor, block: tuple[int, int], offset: int = 0, dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_blocks`` of a rank's ``plain`` part whose first row (``dim`` 0) or column (``dim`` 1)
    sits ``offset`` into its tile: zeros stand in for what comes before it on the tile grid, and the
    float8 values are returned without them."""
    pad = [0, 0, 0, 0]
    pad[2 if dim == 0 else 0] = offset  # F.pad: last dim first
    q, tiles = quantize_blocks(F.pad(plain, pad), block)
    return q.narrow(dim, offset, plain.shape[dim]), tiles


def _scale_shape(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])


def _scale_shape_error(actual: tuple[int, ...], shape: tuple[int, int], block: tuple[int, int]) -> str:
    return (
        f"weight_scale_inv has shape {actual}, expected {_scale_shape(shape, block)} for a "
        f"{shape[0]}×{shape[1]} weight in {block[0]}×{block[1]} blocks"
    )


@dataclass(frozen=True)
class _Tiles(Shard):
    """Tiles ``[start, stop)`` along ``dim`` of a scale tensor, whatever the rank: the tiles that cover
    one of the weight's shard ranges."""

    start: int = 0
    stop: int = 0

    def ranges(self, length: int, rank: int, size: int, name: str) -> list[tuple[int, int]]:
        return [(self.start, self.stop)]


class WeightReader:
    """``get`` as CheckpointReader's, dequantizing tensors that come with a ``_scale_inv`` companion."""

    def __init__(self, reader: CheckpointReader, block: tuple[int, int] | None) -> None:
        self.reader = reader
        self.block = block

    def __contains__(self, name: str) -> bool:
        return name in self.reader

    def get(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, shard: Shard | None = None
    ) -> torch.Tensor:
        """Tensor ``name`` (full shape ``shape``) in ``dtype``; with ``shard`` only this rank's part."""
        scale_name = name + "_scale_inv"
        if scale_name not in self.reader:
            tensor = self.reader.get(name, shape, shard=shard)
            if tensor.dtype in FP8_DTYPES:  # a bare cast would drop the block scales
                raise CheckpointError(f"tensor '{name}' is stored in FP8 without its '{scale_name}'")
            return tensor.to(dtype)
        if self.block is None:
            raise CheckpointError(
                f"tensor '{scale_name}' is in the checkpoint but config.json has no FP8 quantization_config"
            )
        weight = self.reader.get(name, shape, shard=shard)
        try:
            if shard is None:
                dense = dequantize_blocks(weight, self.reader.get(scale_name), self.block)
            else:
                dense = weight.float() * self._shard_scale(name, scale_name, shard, weight.shape)
        except CheckpointError as exc:
            raise CheckpointError(f"tensor '{scale_name}': {exc}") from None
        return dense.to(dtype)

    def get_blocks(
        self, name: str, shape: tuple[int, int], shard: Shard | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Block-FP8 tensor ``name`` kept quantized: (its float8 values, the rank's part with ``shard``;
        the float32 scales of the tiles that cover that part). A shard must be one range of the split
        dimension; its start's place inside the first tile is the caller's to know (``start % block``)."""
        scale_name = name + "_scale_inv"
        if self.block is None or scale_name not in self.reader:
            raise CheckpointError(
                f"tensor '{name}' is not block-FP8 (no '{scale_name}' or no quantization_config)"
            )
        weight = self.reader.get(name, shape, shard=shard)
        if weight.dtype != torch.float8_e4m3fn:
            raise CheckpointError(
                f"tensor '{name}' has its block scales but is stored in {weight.dtype}, not FP8"
            )
        stored = self.reader.shape(scale_name)
        if stored != _scale_shape(shape, self.block):
            raise CheckpointError(f"tensor '{scale_name}': {_scale_shape_error(stored, shape, self.block)}")
        if shard is None:
            return weight, self.reader.get(scale_name).float()
        dim = shard.dim % 2
        ranges = shard.ranges(shape[dim], self.reader.rank, self.reader.world_size, name)
        if len(ranges) != 1:
            raise CheckpointError(f"tensor '{name}': a block-FP8 shard must be one range, not {ranges}")
        (start, stop), block = ranges[0], self.block[dim]
        tiles = _Tiles(dim, start=start // block, stop=-(-stop // block))
        return weight, self.reader.get(scale_name, shard=tiles).float()

    def _shard_scale(self, name: str, scale_name: str, shard: Shard, local: tuple[int, ...]) -> torch.Tensor:
        """The float32 scale of every element of the rank's part (``local``, as read) of weight ``name``,
        from the tiles that cover it: only the tile rows (or columns) of the rank's ranges are read."""
        assert self.block is not None
        shape = self.reader.shape(name)
        if len(shape) != 2:
            raise CheckpointError(f"a block-quantized weight must be 2-D, '{name}' has shape {shape}")
        full = (shape[0], shape[1])
        stored = self.reader.shape(scale_name)
        if stored != _scale_shape(full, self.block):
            raise CheckpointError(_scale_shape_error(stored, full, self.block))
        dim = shard.dim % 2
        other = 1 - dim
        block, block_other = self.block[dim], self.block[other]
        pieces = []
        for start, stop in shard.ranges(full[dim], self.reader.rank, self.reader.world_size, name):
            if start == stop:
                continue
            first, last = start // block, -(-stop // block)
            tiles = self.reader.get(scale_name, shard=_Tiles(dim, start=first, stop=last)).float()
            pieces.append(
                tiles.repeat_interleave(block, dim=dim).narrow(dim, start - first * block, stop - start)
            )
        other_len = stored[other]
        if pieces:
            scale = torch.cat(pieces, dim=dim)
        else:  # a rank that holds only padding rows
            scale = torch.zeros((0, other_len) if dim == 0 else (other_len, 0))
        scale = scale.repeat_interleave(block_other, dim=other).narrow(other, 0, full[other])
        missing = local[dim] - scale.shape[dim]
        if missing > 0:  # zero padding (vocab-parallel rows): its weight rows are zeros anyway
            pad = list(scale.shape)
            pad[dim] = missing
            scale = torch.cat([scale, scale.new_zeros(pad)], dim=dim)
        return scale


def load_projection(
    reader: WeightReader,
    target: torch.Tensor | BlockFP8Weight,
    name: str,
    shape: tuple[int, int],
    shard: Shard | None = None,
    rows: slice | None = None,
) -> None:
    """Fill ``target`` (rows ``rows`` of it, all by default) with checkpoint tensor ``name`` of full
    ``shape``, this rank's part with ``shard``: dequantized into a plain parameter, or kept float8 in a
    :class:`BlockFP8Weight` with its tiles' scales given to every row. A plain tensor (``model.
    quantization=fp8``, or one an FP8 checkpoint left unquantized) is quantized on the target's column
    grid, its rows tiled from the rank's first row."""
    rows = rows if rows is not None else slice(0, target.shape[0])
    if not isinstance(target, BlockFP8Weight):
        with torch.no_grad():
            target[rows].copy_(reader.get(name, shape, target.dtype, shard))
        return
    block = target.block
    dim = None if shard is None else shard.dim % 2
    if reader.block is not None and name + "_scale_inv" in reader:
        weight, tiles = reader.get_blocks(name, shape, shard)
        start = 0
        if dim is not None:
            start = shard.ranges(shape[dim], reader.reader.rank, reader.reader.world_size, name)[0][0]
        offset = start % reader.block[1] if dim == 1 else 0
        scales = row_scales(tiles, reader.block[0], start if dim == 0 else 0, weight.shape[0])
    else:
        plain = reader.get(name, shape, torch.float32, shard)
        offset = target.offset  # the grid's columns before the rank's first one stand in as zeros
        weight, tiles = quantize_from(plain, (block, block), offset)
        scales = row_scales(tiles, block, 0, weight.shape[0])
    if offset != target.offset or tiles.shape[1] != target.scale.shape[1]:
        raise CheckpointError(
            f"tensor '{name}': this rank's columns start {offset} into a tile over {tiles.shape[1]} tiles, "
            f"the model expects {target.offset} over {target.scale.shape[1]}"
        )
    try:
        target.load_rows(rows, weight, scales)
    except ValueError as exc:
        raise CheckpointError(f"tensor '{name}': {exc}") from None
