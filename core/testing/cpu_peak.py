"""The peak of CPU memory a call allocates, for memory-plan tests off the GPU (torch keeps peak statistics
only for its CUDA allocator). Built from the profiler's allocator records: an op's own allocations count
from its start, its own frees from its end, so an allocation and free inside one op still reach the
peak, and the figure errs high, never low."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from torch.profiler import ProfilerActivity, profile

T = TypeVar("T")


def peak_cpu_bytes(fn: Callable[[], T]) -> tuple[T, int]:
    """(``fn()``, the most bytes allocated during it beyond what was allocated before it)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    changes = []
    for event in prof.events():
        delta = event.self_cpu_memory_usage
        if delta:
            changes.append((event.time_range.start if delta > 0 else event.time_range.end, delta))
    live = peak = 0
    for _, delta in sorted(changes):
        live += delta
        peak = max(peak, live)
    return result, peak
