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
    ``[num_state_slots, *shape]``; ``snapshots[layer][name]``: ``[num_snapshot_slots, *shape]``, copies of
    state slots kept at page boundaries for prefix caching (a model sees them only when it saves states inside
    a chunk: ``ForwardBatch.checkpoints``)."""

    def __init__(self, specs: list[BufferSpec], plan: MemoryPlan, device: torch.device) -> None:
        self.plan = plan
        self.device = device
        self.caches: dict[CacheKey, torch.Tensor] = {}
        self.states: dict[int, dict[str, torch.Tensor]] = {}
        self.snapshots: dict[int, dict[str, torch.Tensor]] = {}
        for spec in specs:
            if isinstance(spec, PAGED_SPECS):
                shape = spec.page_shape(plan.num_blocks, plan.block_size)
                self.caches[spec.key] = torch.zeros(shape, dtype=spec.dtype, device=device)
            elif isinstance(spec, RecurrentStateSpec):
                self.states[spec.layer_index] = {
                    name: torch.zeros((plan.num_state_slots, *shape), dtype=spec.dtype, device=device)
                    for name, shape in spec.shapes
                }
                if plan.num_snapshot_slots:
                    self.snapshots[spec.layer_index] = {
                        name: torch.zeros((plan.num_snapshot_slots, *shape), dtype=spec.dtype, device=device)
                        for name, shape in spec.shapes
                    }
        self._state_tensors = [t for pools in self.states.values() for t in pools.values()]
        self._pairs = [
            (self.states[layer][name], self.snapshots[layer][name])
            for layer, pools in self.snapshots.items()
            for name in pools
        ]

    def zero_slots(self, slots: list[int]) -> None:
        """Clear state slots whose new owner starts from position 0 (a fresh or recomputed request)."""
        if not slots or not self._state_tensors:
            return
        index = torch.tensor(slots, dtype=torch.int64, device=self.device)
        for tensor in self._state_tensors:
            tensor.index_fill_(0, index, 0)

    def copy_snapshots(self, copies: list[tuple[int, int]], *, save: bool) -> None:
        """Copy whole states between the request slots and the snapshot pool: ``copies`` are (state slot,
        snapshot slot) pairs, state into snapshot when ``save``, else snapshot into state (a prefix hit
        resuming at the snapshot's page boundary). Every rank runs the same copies on its own shard."""
        if not copies or not self._pairs:
            return
        pinned = self.device.type == "cuda"  # staged through pinned memory: the copy does not wait
        index = torch.tensor(copies, dtype=torch.int64, pin_memory=pinned).to(self.device, non_blocking=True)
        slots, snaps = index[:, 0], index[:, 1]
        for state, snapshot in self._pairs:
            if save:
                snapshot.index_copy_(0, snaps, state.index_select(0, slots))
            else:
                state.index_copy_(0, slots, snapshot.index_select(0, snaps))
