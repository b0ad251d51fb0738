"""The tensor-parallel executor: rank 0's model runner in the engine's process, one runner per further rank.

Each step rank 0 sends the step's plan (``step_message``: ids, counts, positions, the block-table
entries a rank lacks, slots) over the step channel, then runs its own runner; every rank runs the same
batch on its shard and they meet in the collectives inside the model. Rank 0's gathered logits are
returned for the engine to sample; the carried tokens of the next step are broadcast from rank 0 on the
device (``ModelRunner``), so nothing sampled crosses a process boundary.

Failure: a monitor thread watches the worker processes. A rank that raises ends its process after
sending its error; its end (or its death) poisons the executor: the process group is aborted so a
collective rank 0 is blocked in returns, the step raises ``ExecutorError`` naming the rank and its
error, the remaining workers are stopped, and every later call raises the same error at once. A
collective or a plan that waits longer than ``parallel.timeout_s`` fails the same way. ``shutdown``
(and the executor being collected, and the interpreter exiting) stops the workers.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from pegainfer.config.schema import EngineConfig
from pegainfer.errors import ExecutorError, PegainferError
from pegainfer.executor.executor import Executor
from pegainfer.executor.model_batch import DraftInput, ExecutorCapabilities, ExecutorOutput, ModelBatch
from pegainfer.executor.model_runner import ModelRunner
from pegainfer.executor.step_channel import DistChannel, ShmChannel
from pegainfer.executor.step_message import StepEncoder
from pegainfer.executor.tp_launch import SpawnedRanks, check_devices, launched_by_torchrun, torchrun_groups
from pegainfer.model.model_loader import model_class, resolve_registration
from pegainfer.parallel.distributed import TensorParallel, new_group

logger = logging.getLogger(__name__)

T = TypeVar("T")


class TensorParallelExecutor(Executor):
    """``parallel.tensor_parallel_size`` ranks (see the module docstring); rank 0 is ``runner``."""

    def __init__(self, config: EngineConfig) -> None:
        self.size = size = config.parallel.tensor_parallel_size
        device, backend = check_devices(config)
        # A model that cannot shard is refused before any rank starts.
        model_class(resolve_registration(config)[0], size)
        self._failure: ExecutorError | None = None
        self._closed = False
        self._ranks: SpawnedRanks | None = None
        self._channel: ShmChannel | DistChannel | None = None
        self._encoder = StepEncoder()
        try:
            if launched_by_torchrun():
                tp, plan_group = torchrun_groups(config)
                self._channel = DistChannel(plan_group)
            else:
                self._channel = ShmChannel(size - 1, config.parallel.timeout_s)
                self._ranks = ranks = SpawnedRanks(config, self._channel)
                rank_device = torch.device("cuda", 0) if device.type == "cuda" else None
                timeout = config.parallel.timeout_s
                group = ranks.join_group(
                    lambda: new_group(ranks.store, 0, size, backend, timeout, rank_device)
                )
                tp = TensorParallel(0, size, group)
                executor = weakref.ref(self)  # the monitor thread must not keep the executor alive
                ranks.watch(lambda rank: _on_rank_end(executor, rank))
            self.tp = tp
            self.runner = self._guarded(ModelRunner, config, tp)
        except BaseException:
            self.shutdown()
            raise
        self.info = self.runner.info
        self.plan = self.runner.plan
        # Collected without shutdown (or at exit): the workers are told to go at once.
        self._finalizer = weakref.finalize(self, _release, self._ranks, self._channel, False)
        logger.info("tensor parallelism: %d ranks over %s", size, backend)

    @property
    def capabilities(self) -> ExecutorCapabilities:
        return self.runner.capabilities

    @property
    def wait_time_s(self) -> float:
        return self.runner.wait_time_s

    # ------------------------------------------------------------------------------------------- steps

    def execute(self, batch: ModelBatch) -> ExecutorOutput:
        self._send(self._encoder.batch(batch))
        out = self._guarded(self.runner.execute, batch)
        if self._failure is not None:  # a rank failed while the step ran: its logits cannot be trusted
            raise self._failure
        return out

    def propose(self, inputs: list[DraftInput]) -> list[list[int]]:
        self.runner.check_drafting()  # before the ranks are told: a refusal must not fail them
        self._send(self._encoder.drafts(inputs))
        return self._guarded(self.runner.propose, inputs)

    def capture_cuda_graphs(self, *, eager: bool = False) -> None:
        self.runner.check_graph_path(eager=eager)
        self._send(("capture", eager))
        self._guarded(self.runner.capture_cuda_graphs, eager=eager)

    def _send(self, message: tuple) -> None:
        if self._failure is not None:
            raise self._failure
        if self._closed:
            raise ExecutorError("the tensor-parallel executor was shut down")
        self._guarded(self._channel.send, message)

    def _guarded(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn`` on rank 0; any failure poisons the executor (see the module docstring)."""
        if self._failure is not None:
            raise self._failure
        try:
            return fn(*args, **kwargs)
        except BaseException as exc:
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                self.shutdown()
                raise
            # Rank 0's own clear error (a ConfigError naming head counts, a CheckpointError naming a
            # tensor) stays as it is; anything else is most likely a rank that failed under it.
            if isinstance(exc, PegainferError) and not isinstance(exc, ExecutorError):
                self._poison(f"tensor-parallel rank 0 failed: {type(exc).__name__}: {exc}", quiet=True)
                raise
            worker = self._worker_failure(wait_s=2.0)
            raise self._poison(
                worker or f"tensor-parallel rank 0 failed: {type(exc).__name__}: {exc}"
            ) from exc

    # ------------------------------------------------------------------------------------------ health

    def _worker_failure(self, wait_s: float = 0.0) -> str | None:
        """The first worker that ended, with its error, if one did (waiting up to ``wait_s`` for one: a
        collective may fail on rank 0 a moment before the rank that caused it has fully ended)."""
        if self._ranks is None:
            return None
        ended = self._ranks.wait_for_an_end(wait_s) if wait_s else self._ranks.ended()
        if not ended:
            return None
        report = self._ranks.failure(ended[0])
        if "\n" in report:
            logger.error("tensor-parallel rank %d: %s", ended[0], report)
        return f"tensor-parallel rank {ended[0]} failed: {report.splitlines()[0]}"

    def _poison(self, message: str, *, quiet: bool = False) -> ExecutorError:
        """Fail the executor with ``message`` (the first failure wins): wake rank 0 from a collective it
        waits in, end the other ranks. ``quiet``: the caller raises an error of its own that says it all."""
        if self._failure is None:
            self._failure = ExecutorError(message)
            if not quiet:
                logger.error("%s; the executor stops", message)
            group = getattr(getattr(self, "tp", None), "group", None)
            if group is not None:
                try:
                    group.abort()
                except Exception as exc:  # an abort that fails leaves the collective's own timeout
                    logger.debug("process group abort failed: %s", exc)
            if self._ranks is not None:
                self._ranks.terminate(grace_s=0.0, cut_lifelines=True)
        return self._failure

    def shutdown(self) -> None:
        """Stop the workers (a stop message, then terminate what is left). Idempotent."""
        if self._closed:
            return
        self._closed = True
        told = False
        if self._failure is None and self._channel is not None and hasattr(self, "runner"):
            try:
                self._channel.send(("stop",))
                told = True
            except Exception as exc:  # the workers are stopped below either way
                logger.debug("stop message not delivered: %s", exc)
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer.detach()
        _release(self._ranks, self._channel, told)


def _on_rank_end(executor: weakref.ref, rank: int) -> None:
    """The monitor's call when a worker ends: the executor (if it still exists) is failed."""
    alive = executor()
    if alive is not None and not alive._closed:
        alive._poison(alive._worker_failure() or f"tensor-parallel rank {rank} ended")


def _release(ranks: SpawnedRanks | None, channel: ShmChannel | DistChannel | None, told: bool) -> None:
    """End the workers (given ``told``: a stop message was sent, a moment to obey it) and free what this
    side holds of them."""
    if ranks is not None:
        ranks.terminate(grace_s=5.0 if told else 0.0, cut_lifelines=not told)
        ranks.release()
    if isinstance(channel, ShmChannel):
        channel.close()
