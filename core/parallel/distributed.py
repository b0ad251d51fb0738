"""Tensor parallelism: one rank's view of its group, and the collectives model layers call.

A ``TensorParallel`` is handed to a model at construction (``CausalLM.from_hf_config(..., tp=...)``): its
``rank`` and ``size`` decide which shard of each weight the rank holds (``split`` and ``heads`` check the
counts and fail closed with an error naming them), and its collectives join the shards' partial results.
At size 1 every collective returns its input untouched, so a model file has one code path.

Process groups are plain c10d backends (``ProcessGroupGloo`` on the CPU, ``ProcessGroupNCCL`` on CUDA)
built on a ``TCPStore``, not torch.distributed's global default group: one process may hold several
engines one after another (tests), and nothing global has to be torn down between them. Collectives
are issued on the current stream's terms (``Work.wait``), so they are captured in CUDA graphs.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pegainfer.errors import ConfigError

#: NVLink multicast stays off on the GPU hosts we run on: set in every process that may start NCCL.
MULTICAST_OFF_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


#: NCCL's watchdog on a collective that fails or times out: abort the communicators and let the waiting
#: call raise (2), not end the process (torch's default), so the engine fails its requests and lives on.
NCCL_ERROR_HANDLING = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")


def set_collective_env() -> None:
    """In this process and its children: NVLink multicast off (``MULTICAST_OFF_ENV``, always) and NCCL's
    error handling (``NCCL_ERROR_HANDLING``, unless the user chose one)."""
    for key, value in MULTICAST_OFF_ENV.items():
        os.environ[key] = value
    os.environ.setdefault(*NCCL_ERROR_HANDLING)


@dataclass(frozen=True)
class TensorParallel:
    """Rank ``rank`` of ``size`` tensor-parallel ranks over ``group`` (None only at size 1: no collective
    runs; a one-rank group still issues them, which the GPU tests use to run NCCL on one device)."""

    rank: int = 0
    size: int = 1
    group: Any = None
    #: The rank's index among the ranks of its host: its GPU there (``torchrun``'s ``LOCAL_RANK``).
    local_rank: int | None = None

    @property
    def device_index(self) -> int:
        return self.rank if self.local_rank is None else self.local_rank

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size or (self.group is None and self.size > 1):
            raise ValueError(f"rank {self.rank} of {self.size} with group {self.group!r}")

    # ------------------------------------------------------------------------------------- shard sizes

    def split(self, count: int, what: str) -> int:
        """This rank's share of ``count`` items (heads, channels, experts) split evenly over the ranks;
        a ConfigError naming ``what`` and both counts when they do not divide."""
        if count % self.size:
            raise ConfigError(
                f"{what}: {count} cannot be split evenly over tensor-parallel size {self.size}; choose a tp "
                f"that divides {count}"
            )
        return count // self.size

    def heads(self, count: int, what: str) -> tuple[int, int]:
        """(heads this rank holds, index of its first head) for ``count`` heads that are split over the
        ranks, or, when there are fewer heads than ranks, replicated: each head then serves ``size /
        count`` consecutive ranks (the query heads of those ranks are the ones that share it)."""
        if count >= self.size:
            local = self.split(count, what)
            return local, self.rank * local
        if self.size % count:
            raise ConfigError(
                f"{what}: {count} heads cannot be replicated evenly over tensor-parallel size {self.size}; "
                f"choose a tp that is a multiple or a divisor of {count}"
            )
        return 1, self.rank // (self.size // count)

    # -------------------------------------------------------------------------------------- collectives

    def all_reduce(self, x: torch.Tensor, op: Any = None) -> torch.Tensor:
        """Sum (or ``op``) of ``x`` over the ranks, in place; returns ``x``."""
        if self.group is not None:
            opts = dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp.SUM if op is None else op
            self.group.allreduce([x], opts).wait()
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' ``x`` (equal shapes) concatenated along ``dim`` in rank order."""
        if self.group is None:
            return x
        x = x.contiguous()
        out = x.new_empty((self.size * x.shape[0], *x.shape[1:]))
        self.group._allgather_base(out, x).wait()
        return torch.cat(out.view(self.size, *x.shape).unbind(0), dim=dim)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank ``src``'s ``x`` written into every rank's ``x``, in place; returns ``x``."""
        if self.group is not None:
            opts = dist.BroadcastOptions()
            opts.rootRank = src
            self.group.broadcast([x], opts).wait()
        return x

    def min_int(self, value: int) -> int:
        """The smallest ``value`` any rank passes (a host integer; a collective on every rank)."""
        if self.group is None:
            return value
        device = "cuda" if _is_nccl(self.group) else "cpu"
        t = torch.tensor([value], dtype=torch.int64, device=device)
        return int(self.all_reduce(t, dist.ReduceOp.MIN).item())


def _is_nccl(group: Any) -> bool:
    return type(group).__name__ == "ProcessGroupNCCL"


def backend_for(device: torch.device) -> str:
    """The collective backend of a device type: NCCL on CUDA, gloo on the CPU; a ConfigError when this
    torch build lacks it (checked before any process starts or weight is read)."""
    if not dist.is_available():
        raise ConfigError("tensor parallelism needs torch.distributed, which this torch build lacks")
    if device.type == "cuda":
        if not dist.is_nccl_available():
            raise ConfigError("tensor parallelism on CUDA needs NCCL, which this torch build lacks")
        return "nccl"
    if not dist.is_gloo_available():
        raise ConfigError("tensor parallelism on the CPU needs gloo, which this torch build lacks")
    return "gloo"


def new_group(
    store: Any, rank: int, size: int, backend: str, timeout_s: float, device: torch.device | None = None
) -> Any:
    """A process group of ``size`` ranks over ``store`` (blocks until every rank has joined or
    ``timeout_s`` passed). Collectives on it time out after ``timeout_s`` too, so a rank that stops
    answering fails the others instead of hanging them."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    group = dist.ProcessGroupNCCL(store, rank, size, opts)
    if device is not None:
        group.eager_connect_single_device(device)
    return group


def create_store(host: str, port: int, world_size: int, *, is_master: bool, timeout_s: float) -> Any:
    """The rendezvous key-value store (``port`` 0 on the master: a free port, read back from ``.port``)."""
    return dist.TCPStore(
        host,
        port,
        world_size,
        is_master=is_master,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )
