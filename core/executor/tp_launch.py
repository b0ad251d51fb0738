"""Starting a tensor-parallel group: spawned rank workers on one host, or ranks ``torchrun`` started.

Spawned (the default): rank 0 is the engine's own process. It hosts the rendezvous store, starts one
worker process per further rank and waits until each has reached the store, so a worker that fails
while starting (an import error, a bad config) is reported at once with its own message instead of as
a timeout. Rank 0 stays in the engine's process because the sampler needs its logits and samples on
its device: no logits ever cross a process boundary, and the single-rank path is the same code.

``torchrun`` (ranks on one or several hosts): every process runs the same command; rank 0 (``RANK``)
runs the engine and the server, the others ``tp_worker.run_torchrun_rank``. The store comes from
torch.distributed's env:// rendezvous, and the plan is broadcast over a gloo group (shared memory does
not cross hosts).
"""

from __future__ import annotations

import datetime
import os
import pickle
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pegainfer.config.schema import EngineConfig
from pegainfer.errors import ConfigError, ExecutorError
from pegainfer.executor.step_channel import ShmChannel
from pegainfer.model.model_loader import pick_device
from pegainfer.parallel.distributed import (
    TensorParallel,
    backend_for,
    create_store,
    new_group,
    set_collective_env,
)

READY_KEY = "pegainfer/ready/{rank}"

TP_GROUP_PREFIX = "pegainfer/tp"
PLAN_GROUP_PREFIX = "pegainfer/plan"


def launched_by_torchrun() -> bool:
    """Whether this process is one rank of a ``torchrun`` (or any env:// launcher) of several ranks."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ


def torchrun_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def check_devices(config: EngineConfig) -> tuple[torch.device, str]:
    """The device type and collective backend of a tp > 1 run; a ConfigError, before anything starts,
    when they cannot serve ``tp`` ranks."""
    size = config.parallel.tensor_parallel_size
    device = pick_device(config.device)
    backend = backend_for(device)
    if device.type == "cuda":
        local = int(os.environ.get("LOCAL_WORLD_SIZE", size)) if launched_by_torchrun() else size
        if torch.cuda.device_count() < local:
            raise ConfigError(
                f"tp={size} needs {local} CUDA devices on this host, but torch sees "
                f"{torch.cuda.device_count()}; lower tp or make more GPUs visible"
            )
    return device, backend


def torchrun_groups(config: EngineConfig) -> tuple[TensorParallel, Any]:
    """This torchrun rank's tensor-parallel group and the gloo group the plan is broadcast on."""
    size = config.parallel.tensor_parallel_size
    world = int(os.environ["WORLD_SIZE"])
    if world != size:
        raise ConfigError(f"torchrun started {world} ranks, but tp={size}; launch exactly tp ranks")
    device, backend = check_devices(config)
    set_collective_env()
    timeout = config.parallel.timeout_s
    store, rank, _ = next(dist.rendezvous("env://", timeout=datetime.timedelta(seconds=timeout)))
    local = int(os.environ.get("LOCAL_RANK", rank))
    rank_device = torch.device("cuda", local) if device.type == "cuda" else None
    group = new_group(dist.PrefixStore(TP_GROUP_PREFIX, store), rank, size, backend, timeout, rank_device)
    plan = new_group(dist.PrefixStore(PLAN_GROUP_PREFIX, store), rank, size, "gloo", timeout)
    return TensorParallel(rank, size, group, local_rank=local), plan


class SpawnedRanks:
    """Ranks 1..size-1 as child processes of this one (``python -m pegainfer.executor.tp_worker``: a fresh
    interpreter that loads the plugins, its shard and its buffers itself, and never runs the user's
    main module). Each child gets its step-channel pipe ends, a pipe to report a failure on (whose
    end-of-file also says the child ended), and a lifeline pipe whose end-of-file makes it exit.

    ``watch`` starts a thread that calls back once a child ends; ``terminate`` ends the children;
    ``release`` (after that) stops the thread and closes every pipe end this side holds."""

    def __init__(self, config: EngineConfig, channel: ShmChannel) -> None:
        size = config.parallel.tensor_parallel_size
        self.timeout_s = timeout = config.parallel.timeout_s
        set_collective_env()  # the children inherit the environment
        self.store = create_store("127.0.0.1", 0, size, is_master=True, timeout_s=timeout)
        self.processes: list[subprocess.Popen] = []
        self._errors: list[int] = []  # our read ends of the children's error pipes
        self._lifelines: list[int] = []  # our write ends of the children's lifelines
        self._reports: dict[int, str] = {}
        self._reading = threading.Lock()  # the monitor thread and a failed step may both ask
        self._stop_watching = threading.Event()
        self._monitor: threading.Thread | None = None
        try:
            for rank in range(1, size):
                self._start(rank, size, config, channel)
            self._wait_ready(timeout)
        except BaseException:
            self.terminate(grace_s=0.0)
            self.release()
            raise

    def _start(self, rank: int, size: int, config: EngineConfig, channel: ShmChannel) -> None:
        error_r, error_w = os.pipe()
        life_r, life_w = os.pipe()
        ready, free = channel.reader_fds(rank - 1)
        self._errors.append(error_r)
        self._lifelines.append(life_w)
        spec = WorkerSpec(
            rank,
            size,
            config,
            self.store.port,
            channel.name,
            ready,
            free,
            error_w,
            life_r,
            torch.get_num_threads(),
        )
        try:
            process = subprocess.Popen(
                [sys.executable, "-m", "pegainfer.executor.tp_worker"],
                stdin=subprocess.PIPE,
                pass_fds=(ready, free, error_w, life_r),
            )
        finally:
            for fd in (error_w, life_r):
                os.close(fd)
            channel.close_reader_ends(rank - 1)
        self.processes.append(process)
        process.stdin.write(pickle.dumps(spec))
        process.stdin.close()

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        waiting = set(range(1, len(self.processes) + 1))
        while waiting:
            for rank in sorted(waiting):
                if self.store.check([READY_KEY.format(rank=rank)]):
                    waiting.discard(rank)
                elif self.processes[rank - 1].poll() is not None:
                    raise ExecutorError(f"tensor-parallel rank {rank} failed to start: {self.failure(rank)}")
            if time.monotonic() > deadline:
                raise ExecutorError(
                    f"tensor-parallel ranks {sorted(waiting)} did not start in {timeout_s:.0f} s"
                )
            time.sleep(0.01)

    def join_group(self, make_group: Callable[[], Any]) -> Any:
        """``make_group()`` (rank 0's side of the group, which blocks until every rank joined), unless a
        child ends first: then an ExecutorError with that rank's own message, at once."""
        made: dict[str, Any] = {}

        def join() -> None:
            try:
                made["group"] = make_group()
            except BaseException as exc:  # handed to the waiting thread
                made["error"] = exc

        joiner = threading.Thread(target=join, name="pegainfer-tp-join", daemon=True)
        joiner.start()
        while joiner.is_alive():
            joiner.join(0.05)
            ended = self.ended()
            if ended and "group" not in made:
                rank = ended[0]
                raise ExecutorError(f"tensor-parallel rank {rank} failed to start: {self.failure(rank)}")
        if "error" in made:
            raise made["error"]
        return made["group"]

    def ended(self) -> list[int]:
        """The ranks whose process has ended, or is ending: its error pipe has a report or is closed."""
        ending = set(select.select(self._errors, [], [], 0)[0])
        return [
            rank
            for rank, (process, fd) in enumerate(zip(self.processes, self._errors, strict=True), start=1)
            if process.poll() is not None or fd in ending
        ]

    def wait_for_an_end(self, timeout_s: float) -> list[int]:
        """The ranks that ended within ``timeout_s`` (returns as soon as one does)."""
        select.select(self._errors, [], [], timeout_s)
        return self.ended()

    def watch(self, on_end: Callable[[int], None]) -> None:
        """Call ``on_end(rank)`` (on a thread of its own) when the first child ends."""
        errors, stop = list(self._errors), self._stop_watching

        def monitor() -> None:
            while not stop.is_set():
                if select.select(errors, [], [], 0.2)[0] and not stop.is_set():
                    on_end(self.ended()[0])
                    return

        self._monitor = threading.Thread(target=monitor, name="pegainfer-tp-monitor", daemon=True)
        self._monitor.start()

    def failure(self, rank: int) -> str:
        """Rank ``rank``'s own error message, if it sent one, else how it ended."""
        with self._reading:
            if rank not in self._reports:
                self._reports[rank] = self._read_report(rank)
            return self._reports[rank]

    def _read_report(self, rank: int) -> str:
        fd, process = self._errors[rank - 1], self.processes[rank - 1]
        chunks = []
        try:
            while select.select([fd], [], [], 1.0)[0]:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    break
                chunks.append(chunk)
        except (OSError, ValueError):  # released already: how it ended is all there is
            pass
        text = b"".join(chunks).decode(errors="replace").strip()
        try:
            code = process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            code = None
        return text or f"the process ended with exit code {code}"

    def terminate(self, grace_s: float, *, cut_lifelines: bool = False) -> None:
        """Wait up to ``grace_s`` for the children to end (``cut_lifelines``: tell them to, first), then
        terminate and kill what is left."""
        if cut_lifelines:
            for fd in self._lifelines:
                _close(fd)
            self._lifelines = []
        deadline = time.monotonic() + grace_s
        for process in self.processes:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for process in self.processes:
            for signal_them in (process.terminate, process.kill):
                if process.poll() is None:
                    signal_them()
                    try:
                        process.wait(1.0)
                    except subprocess.TimeoutExpired:
                        pass

    def release(self) -> None:
        """Stop watching and close this side's pipe ends (after ``terminate``). Idempotent."""
        self._stop_watching.set()
        monitor = self._monitor
        if monitor is not None and monitor is not threading.current_thread():
            monitor.join()
        for fd in (*self._lifelines, *self._errors):
            _close(fd)
        self._lifelines, self._errors = [], []


@dataclass(frozen=True)
class WorkerSpec:
    """What a spawned rank reads from its stdin: who it is, where to meet, and its inherited pipe ends."""

    rank: int
    size: int
    config: EngineConfig
    store_port: int
    shm_name: str
    ready_fd: int
    free_fd: int
    error_fd: int
    lifeline_fd: int
    num_threads: int


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
