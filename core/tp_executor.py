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
import select
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from pegainfer.config import EngineConfig
from pegainfer.distributed import TensorParallel, new_group
from pegainfer.errors import ExecutorError, PegainferError
from pegainfer.executor import Executor
from pegainfer.model_batch import DraftInput, ExecutorCapabilities, ExecutorOutput, ModelBatch
from pegainfer.model_loader import model_class, resolve_registration
from pegainfer.model_runner import ModelRunner
from pegainfer.step_channel import DistChannel, ShmChannel
from pegainfer.step_message import StepEncoder
from pegainfer.tp_launch import SpawnedRanks, check_devices, launched_by_torchrun, torchrun_groups

logger = logging.getLogger(__name__)

T = TypeVar("T")


class TensorParallelExecutor(Executor):
    """``parallel.tensor_parallel_size`` ranks (see the module docstring); rank 0 is ``runner``."""

    def __init__(self, config: EngineConfig) -> None:
        self.size = size = config.parallel.tensor_parallel_size
        device, backend = check_devices(config)
        model_class(
            resolve_registration(config)[0], size
        )  # a model that cannot shard: before any rank starts
        self._failure: ExecutorError | None = None
        self._closed = False
        self._ranks: SpawnedRanks | None = None
        self._channel: ShmChannel | DistChannel | None = None
        self._encoder = StepEncoder()
        self._stop_monitor = threading.Event()
        try:
            if launched_by_torchrun():
                tp, plan_group = torchrun_groups(config)
                self._channel = DistChannel(plan_group)
            else:
                self._channel = ShmChannel(size - 1, config.parallel.timeout_s)
                self._ranks = SpawnedRanks(config, self._channel)
                rank_device = torch.device("cuda", 0) if device.type == "cuda" else None
                group = new_group(self._ranks.store, 0, size, backend, config.parallel.timeout_s, rank_device)
                tp = TensorParallel(0, size, group)
            self.tp = tp
            self._start_monitor()
            self.runner = self._guarded(ModelRunner, config, tp)
        except BaseException:
            self.shutdown()
            raise
        self.info = self.runner.info
        self.plan = self.runner.plan
        self._finalizer = weakref.finalize(self, _stop, self._ranks, self._channel, self._stop_monitor)
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
        return self._guarded(self.runner.execute, batch)

    def propose(self, inputs: list[DraftInput]) -> list[list[int]]:
        self._send(self._encoder.drafts(inputs))
        return self._guarded(self.runner.propose, inputs)

    def capture_decode_graphs(self, *, eager: bool = False) -> None:
        self._send(("capture", eager))
        self._guarded(self.runner.capture_decode_graphs, eager=eager)

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
            worker = self._await_worker_failure()
            raise self._poison(
                worker or f"tensor-parallel rank 0 failed: {type(exc).__name__}: {exc}"
            ) from exc

    # ------------------------------------------------------------------------------------------ health

    def _await_worker_failure(self, grace_s: float = 2.0) -> str | None:
        """A worker's failure, waiting ``grace_s`` for one: a collective may fail on rank 0 a moment
        before the rank that caused it has fully ended."""
        if self._ranks is None:
            return None
        select.select(self._ranks.sentinels, [], [], grace_s)
        return self._worker_failure()

    def _worker_failure(self) -> str | None:
        """The first worker that ended, with its error, if one did."""
        if self._ranks is None:
            return None
        ended = self._ranks.ended()
        if not ended:
            return None
        report = self._ranks.failure(ended[0])
        if "\n" in report:
            logger.error("tensor-parallel rank %d: %s", ended[0], report)
        return f"tensor-parallel rank {ended[0]} failed: {report.splitlines()[0]}"

    def _start_monitor(self) -> None:
        if self._ranks is None:
            return  # torchrun watches its ranks and ends the group when one fails
        sentinels = self._ranks.sentinels
        stop = self._stop_monitor
        executor = weakref.ref(self)  # the thread must not keep the executor alive

        def monitor() -> None:
            while not stop.is_set():
                if select.select(sentinels, [], [], 0.2)[0] and not stop.is_set():
                    alive = executor()
                    if alive is not None:
                        alive._poison(alive._worker_failure() or "a tensor-parallel rank ended")
                    return

        threading.Thread(target=monitor, name="pegainfer-tp-monitor", daemon=True).start()

    def _poison(self, message: str, *, quiet: bool = False) -> ExecutorError:
        """Fail the executor with ``message`` (the first failure wins); ``quiet``: the caller raises an
        error of its own that says it all, so nothing is logged."""
        if self._failure is None:
            self._failure = ExecutorError(message)
            if not quiet:
                logger.error("%s; the executor stops", message)
            group = getattr(getattr(self, "tp", None), "group", None)
            if group is not None:
                try:  # wakes rank 0 if it waits in a collective for the failed rank
                    group.abort()
                except Exception as exc:  # an abort that fails leaves the collective's own timeout
                    logger.debug("process group abort failed: %s", exc)
            if self._ranks is not None:
                self._ranks.stop(grace_s=0.0)
        return self._failure

    def shutdown(self) -> None:
        """Stop the workers (a stop message, then terminate what is left). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop_monitor.set()
        if self._failure is None and self._channel is not None and hasattr(self, "runner"):
            try:
                self._channel.send(("stop",))
            except Exception as exc:  # the workers are stopped below either way
                logger.debug("stop message not delivered: %s", exc)
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer()
        else:
            _stop(self._ranks, self._channel, self._stop_monitor)


def _stop(
    ranks: SpawnedRanks | None, channel: ShmChannel | DistChannel | None, monitor: threading.Event
) -> None:
    monitor.set()
    if ranks is not None:
        ranks.stop()
    if isinstance(channel, ShmChannel):
        channel.close()
