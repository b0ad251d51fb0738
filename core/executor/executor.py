"""The Executor seam: runs a model's forward passes for a step and returns the logits that get sampled.

The engine drives an ``Executor`` and cannot tell which one: everything it needs is on this interface.
An executor is built from the EngineConfig by ``build_executor``: a plugin may supply its own through the
``make_executor`` hook; otherwise ``LocalExecutor`` (tp=1: one ``ModelRunner`` in the engine's process)
or the ``TensorParallelExecutor`` (one runner per rank, rank 0 in the engine's process).

Contract: after construction ``info``, ``plan`` and ``capabilities`` are fixed (``capabilities`` may
gain ``cuda_graphs`` through ``capture_cuda_graphs``). ``execute`` runs one ``ModelBatch``; the
returned logits live on rank 0's device and are valid until the next ``execute``. An executor that has
failed (a rank died, a collective timed out) raises ``ExecutorError`` from every later call.
"""

from __future__ import annotations

import gc
from abc import ABC, abstractmethod

import torch

from pegainfer.config.schema import EngineConfig
from pegainfer.errors import ExecutorError, PluginError
from pegainfer.executor.model_batch import (
    DraftInput,
    ExecutorCapabilities,
    ExecutorOutput,
    ModelBatch,
    SequenceChunk,
)
from pegainfer.executor.model_runner import ModelInfo, ModelRunner
from pegainfer.memory.memory_plan import MemoryPlan

__all__ = [
    "DraftInput",
    "Executor",
    "ExecutorCapabilities",
    "ExecutorOutput",
    "LocalExecutor",
    "ModelBatch",
    "SequenceChunk",
    "build_executor",
]


class Executor(ABC):
    #: What the engine knows of the model (vocabulary, context length, device, checkpoint folder).
    info: ModelInfo
    #: Pages, state slots and transients per rank; the engine's BufferManager hands out its indices.
    plan: MemoryPlan
    #: What the executor needs and offers (device embedding, carried tokens, drafting, graphs, tp).
    capabilities: ExecutorCapabilities

    @abstractmethod
    def execute(self, batch: ModelBatch) -> ExecutorOutput:
        """Run one step's forward; KV and state for the chunk tokens are written into the buffers."""

    def propose(self, inputs: list[DraftInput]) -> list[list[int]]:
        """Greedy drafts (``num_drafts`` each) from the model's draft layers, after the step whose chunks
        had ``keep_hidden``; also fills the draft layers' caches at the inputs' positions."""
        raise ExecutorError("this executor does not draft (capabilities.max_speculative_tokens is 0)")

    def capture_cuda_graphs(self, *, eager: bool = False) -> None:
        """Take the bucket-padded decode path from now on: captured CUDA graphs, or with ``eager`` the same
        padded forward without graphs (on any device). Runners on CUDA do this at start already."""
        raise ExecutorError(f"{type(self).__name__} has no decode-graph path")

    @property
    def wait_time_s(self) -> float:
        """Seconds the host spent blocked on the GPU inside the executor since start (0 if not tracked)."""
        return 0.0

    def shutdown(self) -> None:  # noqa: B027 - optional hook: an executor may hold nothing to release
        """Release workers and device memory. Idempotent."""


class LocalExecutor(Executor):
    """Single-process executor: one ``ModelRunner`` on one device, in the engine's process."""

    def __init__(self, config: EngineConfig) -> None:
        self._runner: ModelRunner | None = ModelRunner(config)
        self.info = self._runner.info
        self.plan = self._runner.plan

    @property
    def runner(self) -> ModelRunner:
        if self._runner is None:
            raise ExecutorError("the executor was shut down")
        return self._runner

    @property
    def capabilities(self) -> ExecutorCapabilities:
        return self.runner.capabilities

    def execute(self, batch: ModelBatch) -> ExecutorOutput:
        return self.runner.execute(batch)

    def propose(self, inputs: list[DraftInput]) -> list[list[int]]:
        return self.runner.propose(inputs)

    def capture_cuda_graphs(self, *, eager: bool = False) -> None:
        self.runner.capture_cuda_graphs(eager=eager)

    @property
    def wait_time_s(self) -> float:
        return self.runner.wait_time_s

    def shutdown(self) -> None:
        """Drop the runner (weights, caches, graphs) and hand its device memory back, so another engine
        can start in this process."""
        if self._runner is None:
            return
        device = self._runner.device
        self._runner = None
        gc.collect()  # graphs and patched methods can hold the runner in reference cycles
        if device.type == "cuda":
            torch.cuda.empty_cache()


def build_executor(config: EngineConfig) -> Executor:
    """The executor for ``config``: the model's plugin's (``make_executor`` hook) when it offers one, else
    the local executor at tp=1 and the tensor-parallel one above."""
    from pegainfer.model.model_loader import resolve_registration
    from pegainfer.plugins.registry import plugin_executor

    registration, _, _ = resolve_registration(config)
    made = plugin_executor(config, registration)
    if made is not None:
        if not isinstance(made, Executor):
            raise PluginError(
                f"{registration.origin}: make_executor returned {type(made).__name__}, not a pegainfer Executor"
            )
        return made
    if config.parallel.tensor_parallel_size > 1:
        from pegainfer.executor.tp_executor import TensorParallelExecutor

        return TensorParallelExecutor(config)
    return LocalExecutor(config)
