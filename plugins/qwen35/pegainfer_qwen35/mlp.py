"""The dense SwiGLU feed-forward of Qwen3.5: ``down(silu(gate(x)) * up(x))``, gate|up packed in one GEMM
with their rows interleaved (gate 0, up 0, gate 1, ...: ``interleave_gate_up``), so on CUDA the decode GEMM
applies SiLU·mul in its epilogue and the down projection adds into the residual stream (``projections``).

Tensor parallelism splits the intermediate features: gate and up are column-parallel (this rank's rows),
down row-parallel (the matching columns), and its partial output is all-reduced in place.
"""

from __future__ import annotations

import torch
from torch import nn

from pegainfer.layers.activation import interleave_gate_up
from pegainfer.model.checkpoint import CheckpointReader
from pegainfer.parallel.distributed import TensorParallel
from pegainfer.parallel.sharding import split
from pegainfer_qwen35.pass_buffers import PassBuffers
from pegainfer_qwen35.projections import FoldedNorm, project, project_add, project_silu


class DenseMLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        dtype: torch.dtype,
        tp: TensorParallel | None = None,
    ) -> None:
        """``intermediate_size`` is the checkpoint's; the rank holds ``intermediate_size / tp.size``."""
        super().__init__()
        self.tp = tp = tp or TensorParallel()
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        local = tp.split(intermediate_size, "intermediate_size")
        self.gate_up_proj = nn.Parameter(torch.empty(2 * local, hidden_size, dtype=dtype), False)
        self.down_proj = nn.Parameter(torch.empty(hidden_size, local, dtype=dtype), False)

    def forward(
        self,
        x: torch.Tensor,
        bufs: PassBuffers,
        *,
        static_shapes: bool = False,
        residual: torch.Tensor | None = None,
        norm: FoldedNorm | None = None,
    ) -> torch.Tensor:
        """MLP output of the normed rows ``x`` (with ``norm``: of the un-normed rows, the norm folded into
        ``gate_up_proj``; its shapes are always static); with ``residual`` it is added to it in place and
        ``residual`` returned."""
        act = project_silu(x, self.gate_up_proj, bufs.mlp_gate_up, bufs.mlp_act, norm)
        if residual is not None:
            return project_add(act, self.down_proj, residual, bufs.mlp_down, self.tp)
        return self.tp.all_reduce(project(act, self.down_proj, bufs.mlp_down))  # row-parallel partials

    def load(self, reader: CheckpointReader, prefix: str) -> None:
        h, i, dtype = self.hidden_size, self.intermediate_size, self.down_proj.dtype
        rows, columns = split(0), split(1)
        with torch.no_grad():
            self.gate_up_proj.copy_(
                interleave_gate_up(
                    reader.get(prefix + "gate_proj.weight", (i, h), dtype, rows),
                    reader.get(prefix + "up_proj.weight", (i, h), dtype, rows),
                )
            )
            self.down_proj.copy_(reader.get(prefix + "down_proj.weight", (h, i), dtype, columns))
