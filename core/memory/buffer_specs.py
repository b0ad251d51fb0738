"""What a model needs from device memory, declared per layer (and per role for transients).

A model returns a list of these from ``CausalLM.buffer_specs()``; the BufferManager plans memory from
them and hands out pages, state slots and tensors. Paged specs share one block table per request.

A layer's main cache is ``caches[layer_index]``; a paged spec with a ``name`` is an extra cache of that
layer (DeepSeek-V3.2's indexer keys beside its MLA latents), ``caches[(layer_index, name)]``: see
``cache_key``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: The key of a cache in the model's ``caches``: its layer, or (layer, name) for a layer's named extra cache.
CacheKey = int | tuple[int, str]


def cache_key(layer_index: int, name: str = "") -> CacheKey:
    """``caches``' key for layer ``layer_index``'s cache called ``name`` ("": the layer's main cache)."""
    return (layer_index, name) if name else layer_index


def dtype_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class PagedKVSpec:
    """Standard attention: K and V per token, ``[num_blocks, block_size, num_kv_heads, head_dim]`` each."""

    layer_index: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    #: "" for the layer's main cache, else the name of an extra cache of the layer (``cache_key``).
    name: str = ""

    @property
    def key(self) -> CacheKey:
        return cache_key(self.layer_index, self.name)

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * dtype_size(self.dtype)

    def page_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, self.num_kv_heads, self.head_dim)


@dataclass(frozen=True)
class PagedLatentSpec:
    """MLA: one compressed latent (+ the decoupled rotary key) per token, ``[num_blocks, block_size, dim]``."""

    layer_index: int
    latent_dim: int
    rope_dim: int
    dtype: torch.dtype
    #: "" for the layer's main cache, else the name of an extra cache of the layer (``cache_key``).
    name: str = ""

    @property
    def key(self) -> CacheKey:
        return cache_key(self.layer_index, self.name)

    @property
    def bytes_per_token(self) -> int:
        return (self.latent_dim + self.rope_dim) * dtype_size(self.dtype)

    def page_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (num_blocks, block_size, self.latent_dim + self.rope_dim)


@dataclass(frozen=True)
class RecurrentStateSpec:
    """Per-request state of a recurrent layer (e.g. conv window and delta-rule state), one slot per request.

    ``shapes`` maps a state name to its per-request shape; the pool tensor is ``[num_slots, *shape]``.
    """

    layer_index: int
    shapes: tuple[tuple[str, tuple[int, ...]], ...]
    dtype: torch.dtype

    @property
    def bytes_per_request(self) -> int:
        total = 0
        for _, shape in self.shapes:
            n = 1
            for d in shape:
                n *= d
            total += n
        return total * dtype_size(self.dtype)


@dataclass(frozen=True)
class PagedCompressedSpec:
    """One entry of ``entry_dim`` per ``ratio`` tokens (DeepSeek-V4's compressed KV), in the request's pages.

    Entry ``w`` summarises tokens ``[w·ratio, (w+1)·ratio)`` and lives on the page of token ``w·ratio``,
    row ``(w·ratio mod block_size) // ratio``: a page has ``ceil(block_size / ratio)``
    rows, so a ratio above the block size leaves some pages' row unused, never short.
    """

    layer_index: int
    entry_dim: int
    ratio: int
    dtype: torch.dtype
    #: "" for the layer's main cache, else the name of an extra cache of the layer (``cache_key``).
    name: str = ""

    @property
    def key(self) -> CacheKey:
        return cache_key(self.layer_index, self.name)

    def rows_per_page(self, block_size: int) -> int:
        return -(-block_size // self.ratio)

    def page_bytes(self, block_size: int) -> int:
        return self.rows_per_page(block_size) * self.entry_dim * dtype_size(self.dtype)

    def page_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (num_blocks, self.rows_per_page(block_size), self.entry_dim)


def page_bytes(spec: PagedKVSpec | PagedLatentSpec | PagedCompressedSpec, block_size: int) -> int:
    """Bytes one page of ``spec`` takes."""
    if isinstance(spec, PagedCompressedSpec):
        return spec.page_bytes(block_size)
    return block_size * spec.bytes_per_token


PAGED_SPECS = (PagedKVSpec, PagedLatentSpec, PagedCompressedSpec)
BufferSpec = PagedKVSpec | PagedLatentSpec | PagedCompressedSpec | RecurrentStateSpec


@dataclass(frozen=True)
class TransientSpec:
    """Scratch memory that lives only during a step (pass buffers, decode buffers, sampler scratch, graphs).

    ``bytes_fixed`` is paid once; ``bytes_per_token`` scales with the step's token budget and
    ``bytes_per_seq`` with ``max_num_seqs``. The memory plan reserves all of them before sizing pages.
    """

    role: str
    bytes_fixed: int = 0
    bytes_per_token: int = 0
    bytes_per_seq: int = 0

    def bytes_for(self, max_num_batched_tokens: int, max_num_seqs: int) -> int:
        return (
            self.bytes_fixed
            + self.bytes_per_token * max_num_batched_tokens
            + self.bytes_per_seq * max_num_seqs
        )


def has_recurrent_state(specs: list[BufferSpec]) -> bool:
    """Whether a model with these buffer specs keeps recurrent state in per-request slots."""
    return any(isinstance(spec, RecurrentStateSpec) for spec in specs)
