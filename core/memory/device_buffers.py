"""One rank's device buffers: the page pools and state-slot pools its model reads and writes.

Allocated once, at the sizes the memory plan fixed, from the model's buffer specs at the rank's own
geometry (a tensor-parallel rank holds its own heads' KV and its own heads' recurrent state). Page and
slot indices come from the engine's BufferManager and mean the same on every rank.
"""

from __future__ import annotations

import torch

from pegainfer.memory.buffer_specs import PAGED_SPECS, BufferSpec, CacheKey, RecurrentStateSpec
from pegainfer.memory.memory_plan import MemoryPlan


class DeviceBuffers:
    """``caches[spec.key]``: a layer's page pool (``buffer_specs.cache_key``); ``states[layer][name]``:
    ``[num_state_slots, *shape]``."""

    def __init__(self, specs: list[BufferSpec], plan: MemoryPlan, device: torch.device) -> None:
        self.plan = plan
        self.device = device
        self.caches: dict[CacheKey, torch.Tensor] = {}
        self.states: dict[int, dict[str, torch.Tensor]] = {}
        for spec in specs:
            if isinstance(spec, PAGED_SPECS):
                shape = spec.page_shape(plan.num_blocks, plan.block_size)
                self.caches[spec.key] = torch.zeros(shape, dtype=spec.dtype, device=device)
            elif isinstance(spec, RecurrentStateSpec):
                self.states[spec.layer_index] = {
                    name: torch.zeros((plan.num_state_slots, *shape), dtype=spec.dtype, device=device)
                    for name, shape in spec.shapes
                }
        self._state_tensors = [t for pools in self.states.values() for t in pools.values()]

    def zero_slots(self, slots: list[int]) -> None:
        """Clear state slots whose new owner starts from position 0 (a fresh or recomputed request)."""
        if not slots or not self._state_tensors:
            return
        index = torch.tensor(slots, dtype=torch.int64, device=self.device)
        for tensor in self._state_tensors:
            tensor.index_fill_(0, index, 0)
