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
    state slots: speculative decoding's roll-back points first, then prefix caching's snapshots at page
    boundaries (a model sees them only when it saves states inside a chunk: ``ForwardBatch.checkpoints``)."""

    def __init__(self, specs: list[BufferSpec], plan: MemoryPlan, device: torch.device) -> None:
        self.plan = plan
        self.device = device
        self.caches: dict[CacheKey, torch.Tensor] = {}
        self.states: dict[int, dict[str, torch.Tensor]] = {}
        self.snapshots: dict[int, dict[str, torch.Tensor]] = {}
        # State tensors of one name, shape and dtype (e.g. every GDN layer's "ssm") are slices of one
        # stacked tensor ``[layers, slots, *shape]``, so zeroing slots or copying snapshots is one launch per
        # stack, not one per layer (a prefix hit restores every layer's state before its first forward).
        stacks: dict[tuple, list[int]] = {}
        for spec in specs:
            if isinstance(spec, PAGED_SPECS):
                shape = spec.page_shape(plan.num_blocks, plan.block_size)
                self.caches[spec.key] = torch.zeros(shape, dtype=spec.dtype, device=device)
            elif isinstance(spec, RecurrentStateSpec):
                for name, shape in spec.shapes:
                    stacks.setdefault((name, tuple(shape), spec.dtype), []).append(spec.layer_index)
        self._state_stacks = self._stack(stacks, plan.num_state_slots, self.states)
        self._snapshot_stacks = (
            self._stack(stacks, plan.num_snapshot_slots, self.snapshots) if plan.num_snapshot_slots else []
        )

    def _stack(
        self, stacks: dict[tuple, list[int]], slots: int, pools: dict[int, dict[str, torch.Tensor]]
    ) -> list[torch.Tensor]:
        """One ``[layers, slots, *shape]`` tensor per stack; each layer's pool gets its slice by name."""
        tensors = []
        for (name, shape, dtype), layers in stacks.items():
            stack = torch.zeros((len(layers), slots, *shape), dtype=dtype, device=self.device)
            tensors.append(stack)
            for i, layer in enumerate(layers):
                pools.setdefault(layer, {})[name] = stack[i]
        return tensors

    def zero_slots(self, slots: list[int]) -> None:
        """Clear state slots whose new owner starts from position 0 (a fresh or recomputed request)."""
        if not slots or not self._state_stacks:
            return
        index = torch.tensor(slots, dtype=torch.int64, device=self.device)
        for stack in self._state_stacks:
            stack.index_fill_(1, index, 0)

    def copy_snapshots(self, copies: list[tuple[int, int]], *, save: bool) -> None:
        """Copy whole states between the request slots and the snapshot pool: ``copies`` are (state slot,
        snapshot slot) pairs, state into snapshot when ``save``, else snapshot into state (a prefix hit
        resuming at the snapshot's page boundary, or a roll-back to the last accepted draft). Every rank runs the same copies on its own shard."""
        if not copies or not self._snapshot_stacks:
            return
        pinned = self.device.type == "cuda"  # staged through pinned memory: the copy does not wait
        index = torch.tensor(copies, dtype=torch.int64, pin_memory=pinned).to(self.device, non_blocking=True)
        slots, snaps = index[:, 0], index[:, 1]
        for state, snapshot in zip(self._state_stacks, self._snapshot_stacks, strict=True):
            if save:
                snapshot.index_copy_(1, snaps, state.index_select(1, slots))
            else:
                state.index_copy_(1, slots, snapshot.index_select(1, snaps))
