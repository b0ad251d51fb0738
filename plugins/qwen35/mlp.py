"""The dense SwiGLU feed-forward of Qwen3.5: ``down(silu(gate(x)) * up(x))``, gate|up packed in one GEMM."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pegainfer.loader import CheckpointReader
from pegainfer_qwen35.pass_buffers import PassBuffers


class DenseMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(2 * intermediate_size, hidden_size, dtype=dtype), False)
        self.down_proj = nn.Parameter(torch.empty(hidden_size, intermediate_size, dtype=dtype), False)

    def forward(self, x: torch.Tensor, bufs: PassBuffers, *, static_shapes: bool = False) -> torch.Tensor:
        """MLP output of the normed rows ``x`` into ``bufs.mlp_down`` (its shapes are always static)."""
        gate, up = torch.matmul(x, self.gate_up_proj.t(), out=bufs.mlp_gate_up).chunk(2, dim=-1)
        act = torch.mul(F.silu(gate), up, out=bufs.mlp_act)
        return torch.matmul(act, self.down_proj.t(), out=bufs.mlp_down)

    def load(self, reader: CheckpointReader, prefix: str) -> None:
        h, i, dtype = self.hidden_size, self.intermediate_size, self.down_proj.dtype
        with torch.no_grad():
            self.gate_up_proj.copy_(
                torch.cat(
                    [
                        reader.get(prefix + "gate_proj.weight", (i, h), dtype),
                        reader.get(prefix + "up_proj.weight", (i, h), dtype),
                    ]
                )
            )
            self.down_proj.copy_(reader.get(prefix + "down_proj.weight", (h, i), dtype))
