"""A tensor-parallel rank other than 0: builds its model runner, then runs what rank 0 sends until told to stop.

Two ways in: ``python -m pegainfer.executor.tp_worker`` (a child rank 0 started: its ``WorkerSpec`` comes on
stdin, with the rendezvous store's port and its inherited pipe ends of the shared-memory step channel)
and ``run_torchrun_rank`` (a rank ``torchrun`` started: the store comes from torch.distributed's env://
rendezvous and the plan from a gloo broadcast). Either way the rank loads the plugins itself (entry
points), joins the process group, builds its runner (its shard of the weights, its buffers, the plan all
ranks agree on) and loops.

A spawned rank exits as soon as rank 0's process ends (its lifeline pipe reads end-of-file), so a killed
server leaves no worker behind; any error ends the rank, its message written to rank 0 first.
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
import traceback
from typing import Any

import torch

from pegainfer.errors import ExecutorError
from pegainfer.executor.model_runner import ModelRunner
from pegainfer.executor.step_channel import DistChannel, ShmReader
from pegainfer.executor.step_message import StepDecoder
from pegainfer.executor.tp_launch import READY_KEY, WorkerSpec, torchrun_groups
from pegainfer.model.model_loader import pick_device
from pegainfer.parallel.distributed import (
    TensorParallel,
    backend_for,
    create_store,
    new_group,
    set_collective_env,
)

#: The most of a failure report a rank sends (a pipe's buffer holds it without a reader).
REPORT_BYTES = 16 << 10


def serve(runner: ModelRunner, channel: Any) -> None:
    """Run rank 0's messages on ``runner`` until a ``stop`` message (or an error)."""
    decoder = StepDecoder()
    while True:
        message = channel.recv(idle=True)
        kind = message[0]
        if kind in ("batch", "moved_on"):
            runner.execute(decoder.batch(message))
        elif kind == "drafts":
            runner.propose(decoder.drafts(message))
        elif kind == "capture":
            runner.capture_cuda_graphs(eager=message[1])
        elif kind == "stop":
            return
        else:
            raise ExecutorError(f"unknown step message {kind!r}")


def _hold_lifeline(fd: int) -> None:
    def watch() -> None:
        while os.read(fd, 1):
            pass
        os._exit(1)  # rank 0's process is gone: nothing may outlive it

    threading.Thread(target=watch, name="pegainfer-lifeline", daemon=True).start()


def spawned_main(spec: WorkerSpec) -> None:
    """A child rank: join the group, build the runner, serve rank 0's plans; report any failure."""
    _hold_lifeline(spec.lifeline_fd)
    set_collective_env()
    torch.set_num_threads(spec.num_threads)
    try:
        timeout = spec.config.parallel.timeout_s
        store = create_store("127.0.0.1", spec.store_port, spec.size, is_master=False, timeout_s=timeout)
        store.set(READY_KEY.format(rank=spec.rank), "1")
        device = pick_device(spec.config.device)
        rank_device = torch.device("cuda", spec.rank) if device.type == "cuda" else None
        group = new_group(store, spec.rank, spec.size, backend_for(device), timeout, rank_device)
        runner = ModelRunner(spec.config, TensorParallel(spec.rank, spec.size, group))
        serve(runner, ShmReader(spec.shm_name, spec.ready_fd, spec.free_fd, timeout))
    except BaseException as exc:
        report = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=8)}".encode(errors="replace")
        try:  # one write of at most a pipe's buffer: rank 0 reads it after this process ended
            os.write(spec.error_fd, report[:REPORT_BYTES])
        finally:
            os._exit(1)
    os._exit(0)


def run_torchrun_rank(config: Any) -> None:
    """A non-zero rank of a ``torchrun`` launch: join the group, build the runner, serve rank 0's plans."""
    tp, plan_group = torchrun_groups(config)
    serve(ModelRunner(config, tp), DistChannel(plan_group))


if __name__ == "__main__":
    spawned_main(pickle.load(sys.stdin.buffer))
