"""Shared builders for the kernel tests: paged caches poisoned outside the written tokens, routed-experts
cases (float8 ones included), block-FP8 projection weights, metrics."""

from __future__ import annotations

import os

import torch

from pegainfer.layers.activation import interleave_gate_up
from pegainfer.layers.block_fp8 import BlockFP8Weight, row_scales
from pegainfer.layers.moe import BlockScales

#: Where the small (non-``gpu``) cases run: the interpreter on CPU tensors, else compiled on the GPU.
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64; NaN anywhere in ``out`` fails every threshold."""
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


class PagedKV:
    """A cache ``[2, blocks, block_size, kv_heads, D]`` filled with NaN except the tokens written
    through :meth:`add`, so a kernel that reads a slot it should not produces NaN."""

    def __init__(self, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype, device, gen):
        self.block_size = block_size
        self.cache = torch.full(
            (2, num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype, device=device
        )
        self.free = torch.randperm(num_blocks, generator=gen).tolist()
        self.gen = gen

    def add(self, length: int) -> torch.Tensor:
        """A sequence of ``length`` random tokens on freshly drawn, scattered pages; its block table."""
        pages = [self.free.pop() for _ in range(-(-length // self.block_size))]
        table = torch.tensor(pages, dtype=torch.int32)
        shape = (length, *self.cache.shape[3:])
        k = torch.randn(shape, generator=self.gen).to(self.cache.dtype)
        v = torch.randn(shape, generator=self.gen).to(self.cache.dtype)
        pos = torch.arange(length)
        slots = (table[pos // self.block_size].long() * self.block_size + pos % self.block_size).to(
            self.cache.device
        )
        flat = self.cache.flatten(1, 2)
        flat[0, slots] = k.to(self.cache.device)
        flat[1, slots] = v.to(self.cache.device)
        return table

    def tables(self, tables: list[torch.Tensor], width: int | None = None) -> torch.Tensor:
        """Block tables padded to ``width`` with the id of a poisoned (never written) page."""
        width = width or max(1, max(t.numel() for t in tables))
        poison = self.free[0] if self.free else 0
        out = torch.full((len(tables), width), poison, dtype=torch.int32)
        for i, t in enumerate(tables):
            out[i, : t.numel()] = t
        return out.to(self.cache.device)


def moe_case(tokens, k, experts, hidden, inter, dtype, seed):
    """(x, weights, ids, gate_up, down) of a routed-experts call, drawn on ``DEVICE`` (DeepSeek-V3's 256
    experts are 11 G values: drawn on the CPU they took minutes)."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)

    def randn(*shape, scale):
        # Drawn in the target dtype and scaled in place: an fp32 draw of DeepSeek-V3's experts and its
        # scaled copy (30 GB each) did not fit an 80 GB GPU beside the bf16 result.
        return torch.randn(*shape, generator=gen, device=DEVICE, dtype=dtype).mul_(scale)

    x = randn(tokens, hidden, scale=0.5)
    gate_up = randn(experts, 2 * inter, hidden, scale=hidden**-0.5)
    down = randn(experts, hidden, inter, scale=inter**-0.5)
    # Distinct experts per token, from a skewed pool: some experts get many tokens, some none.
    ids = torch.stack([torch.randperm(experts - 1, generator=gen, device=DEVICE)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=gen, device=DEVICE) * 2.5
    return x, weights, ids, gate_up, down


def quantized_experts(gate_up, down, block, offset, fp8_activations=False):
    """Float8 experts with per-tile scales, as a tensor-parallel rank holds them: its features start
    ``offset`` into their first tile (the tiles before are cut off), so tiles and kernel tiles do not align;
    ``fp8_activations``: their GEMMs are W8A8."""
    fp8_max = torch.finfo(torch.float8_e4m3fn).max

    def quantize(w, row_offset, col_offset):  # w [E, R, C]; the shard starts at (row_offset, col_offset)
        e, r, c = w.shape
        bo, bi = block
        tr, tc = -(-(r + row_offset) // bo), -(-(c + col_offset) // bi)
        padded = torch.zeros(e, tr * bo, tc * bi, dtype=torch.float32, device=w.device)
        padded[:, row_offset : row_offset + r, col_offset : col_offset + c] = w.float()
        tiles = padded.view(e, tr, bo, tc, bi)
        scale = tiles.abs().amax(dim=(2, 4)).clamp(min=1e-12) / fp8_max
        q = (tiles / scale[:, :, None, :, None]).to(torch.float8_e4m3fn).view(e, tr * bo, tc * bi)
        return q[:, row_offset : row_offset + r, col_offset : col_offset + c].contiguous(), scale

    inter = down.shape[2]
    gate, gate_s = quantize(gate_up[:, :inter], offset, 0)
    up, up_s = quantize(gate_up[:, inter:], offset, 0)
    down_q, down_s = quantize(down, 0, offset)
    scales = BlockScales(torch.stack([gate_s, up_s], dim=1), down_s, block, offset, fp8_activations)
    return torch.cat([gate, up], dim=1), down_q, scales


def fp8_weight(gen, n: int, k: int, block: int, offset: int = 0) -> BlockFP8Weight:
    """Random float8 values (spread over e4m3's range) with random positive per-row tile scales."""
    w = BlockFP8Weight(n, k, block, offset)
    values = (torch.randn(n, k, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(n, w.scale.shape[1], generator=gen) * 1e-2 + 1e-3
    w.load_rows(slice(0, n), values, scale)
    return w.to(DEVICE)


def shared_fp8_weight(gen, n: int, k: int, group: int, interleaved: bool) -> BlockFP8Weight:
    """A weight whose rows share scales as a checkpoint's tiles of ``group`` rows make them share (gate
    and up interleaved: two such weights' rows alternating), settled."""
    halves = [fp8_weight(gen, n // 2 if interleaved else n, k, 128) for _ in range(2 if interleaved else 1)]
    for half in halves:
        half.scale.copy_(row_scales(half.scale[::group], group, 0, half.shape[0]))
    if interleaved:
        w = BlockFP8Weight(n, k, 128).to(DEVICE)
        w.load_rows(
            slice(0, n),
            interleave_gate_up(halves[0].weight, halves[1].weight),
            interleave_gate_up(halves[0].scale, halves[1].scale),
        )
    else:
        w = halves[0]
    w.settle_scales()
    return w


def random_x(gen, *shape, dtype):
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)
