"""Ask the L2 cache for a constant tensor ahead of the kernel that will read it.

At batch 1 a layer's latency-bound kernels (the GDN conv, recurrence and gated norm) leave the memory
system idle for several microseconds between two projections. A launch of :func:`prefetch_l2` placed
before them asks the L2 for the next projection's weight with bulk prefetches (``cp.async.bulk.
prefetch.L2``, Hopper on), which complete in the background while those kernels run, so the projection
finds its weight in L2. The launch waits for the previous kernel (PDL), issues its requests and ends.
"""

from __future__ import annotations

import torch

from pegainfer.kernels._triton import l2_prefetch_on, pdl_launch, pdl_start, prefetch_rows_l2, tl, triton

#: Bytes one thread asks for: a weight of 16.8 MB (the 35B-A3B out_proj) takes 32 programs of 128.
CHUNK = 4096
LANES = 128


@triton.jit
def _prefetch_kernel(ptr, rows, CHUNK: tl.constexpr, LANES: tl.constexpr, PDL: tl.constexpr):
    pdl_start(PDL)
    first = tl.program_id(0) * LANES
    prefetch_rows_l2(ptr + first.to(tl.int64) * CHUNK, CHUNK, rows - first, CHUNK, LANES, LANES)


def prefetch_l2(t: torch.Tensor) -> None:
    """Ask the L2 for ``t``'s bytes (a CUDA tensor, contiguous, 16-byte aligned: see
    ``_triton.l2_prefetch_on``), whole ``CHUNK`` pieces from its start; returns at once."""
    rows = t.numel() * t.element_size() // CHUNK
    if rows:
        flat = t.view(-1).view(torch.uint8)
        _prefetch_kernel[(triton.cdiv(rows, LANES),)](
            flat, rows, CHUNK=CHUNK, LANES=LANES, num_warps=LANES // 32, **pdl_launch(t)
        )


def prefetch_weight_ahead(weight: torch.Tensor) -> None:
    """:func:`prefetch_l2` of a layer's next projection ``weight`` where ``ahead`` is on
    (``PEGAINFER_L2_PREFETCH``) for its device; nothing elsewhere."""
    if weight.is_contiguous() and l2_prefetch_on(weight, "ahead", weight):
        prefetch_l2(weight)
