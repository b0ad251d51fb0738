"""Shared builders for the kernel tests: paged caches poisoned outside the written tokens, metrics."""

from __future__ import annotations

import os

import torch

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
