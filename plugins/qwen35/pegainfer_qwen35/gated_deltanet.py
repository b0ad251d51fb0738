"""The Gated DeltaNet mixer (Qwen3.5's ``linear_attention`` layers).

Per token: one GEMM for the packed input projections ``[q|k|v, z, b, a]``; a causal depthwise conv over
q|k|v whose window of the last K-1 inputs lives in the request's state slot; SiLU; q and k L2-normalised
(q also scaled by dk^-0.5); beta = sigmoid(b) and the log decay g = -exp(A_log) softplus(a + dt_bias);
the delta rule, whose state also lives in the slot; a gated RMSNorm with z; the output projection.

Prefill segments run one request at a time (chunked delta rule from the slot's state, written back at the
end of the chunk); all decode rows of a step run as one batch, gathering and scattering their slots.
The padding rows of a CUDA-graph bucket replicate row 0 (its slot, its inputs): they scatter the same new
state into the same slot, so the repeated index is harmless.
Value head j reads q/k head ``j // (Hv / Hk)`` (consecutive heads share, as transformers does).

Tensor parallelism splits the layer by heads: each rank holds Hk/tp key heads and Hv/tp value heads, so
local value head j reads local key head ``j // (Hv / Hk)`` as on one rank. ``in_proj_qkv`` and the conv
channels are stitched per segment (this rank's q heads | k heads | v heads; an even split of the packed
dimension would hand rank 0 all of q and part of k), ``in_proj_z/b/a``, ``dt_bias`` and ``A_log`` are split
by value heads, the gated norm's per-head weight is replicated and ``out_proj`` is row-parallel: its
partial output is all-reduced in place. The conv window and the delta-rule state are the rank's channels
and heads only; they are never reduced.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pegainfer.memory.buffer_specs import RecurrentStateSpec
from pegainfer.model.checkpoint import CheckpointReader
from pegainfer.model.model_api import ForwardBatch
from pegainfer.parallel.distributed import TensorParallel
from pegainfer.parallel.sharding import Shard, split, stitch
from pegainfer_qwen35.config import Qwen35Config, Qwen35Shard
from pegainfer_qwen35.delta_rule import (
    causal_conv_prefill,
    causal_conv_step,
    chunked_delta_rule,
    delta_rule_step,
    l2_normalise,
)
from pegainfer_qwen35.norms import gated_rms_norm
from pegainfer_qwen35.pass_buffers import PassBuffers

#: The slot state of a GDN layer is kept in fp32: the delta-rule state must be, and the conv window (model-
#: dtype values) is stored exactly in fp32 so one RecurrentStateSpec holds both.
STATE_DTYPE = torch.float32


@dataclass
class RecurrentRows:
    """Where each request's tokens are in the batch and which state slot it owns."""

    segments: list[tuple[int, int]]  # (first row, length) of each prefill segment
    segment_slots: torch.Tensor  # [num_segments] int64
    decode_start: int
    num_decodes: int
    decode_slots: torch.Tensor  # [num_decodes] int64

    def prefills(self) -> list[tuple[tuple[int, int], torch.Tensor]]:
        """((first row, length), slot as a 1-element index tensor) per prefill segment."""
        return [(seg, self.segment_slots[i : i + 1]) for i, seg in enumerate(self.segments)]

    @classmethod
    def from_batch(cls, batch: ForwardBatch) -> RecurrentRows:
        if batch.state_slots is None:
            raise RuntimeError("Qwen3.5 needs a state slot per request, but the batch carries none")
        meta = batch.attn
        num_segments = len(meta.prefills)
        return cls(
            segments=[(seg.q_start, seg.q_len) for seg in meta.prefills],
            segment_slots=batch.state_slots[:num_segments],
            decode_start=meta.num_prefill_tokens,
            num_decodes=meta.num_decodes,
            decode_slots=batch.state_slots[num_segments : num_segments + meta.num_decodes],
        )


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class GatedDeltaNet(nn.Module):
    def __init__(
        self,
        config: Qwen35Config,
        layer_index: int,
        dtype: torch.dtype,
        shard: Qwen35Shard | None = None,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.layer_index = layer_index
        self.tp = tp or TensorParallel()
        self.shard = s = shard or Qwen35Shard.of(config, self.tp)
        h, hv = config.hidden_size, s.linear_num_value_heads
        self.splits = [s.conv_dim, s.value_dim, hv, hv]
        self.in_proj = _param(sum(self.splits), h, dtype=dtype)  # [q|k|v ; z ; b ; a], this rank's heads
        self.conv_weight = _param(s.conv_dim, config.conv_kernel, dtype=dtype)
        self.dt_bias = _param(hv, dtype=dtype)
        self.A_log = _param(hv, dtype=dtype)
        self.norm = _param(config.linear_value_head_dim, dtype=dtype)
        self.out_proj = _param(h, s.value_dim, dtype=dtype)

    def state_spec(self) -> RecurrentStateSpec:
        """The slot state of this rank's conv channels and value heads."""
        c, s = self.config, self.shard
        return RecurrentStateSpec(
            self.layer_index,
            (
                ("conv", (s.conv_dim, c.conv_kernel - 1)),
                ("ssm", (s.linear_num_value_heads, s.linear_key_head_dim, s.linear_value_head_dim)),
            ),
            STATE_DTYPE,
        )

    def forward(
        self, x: torch.Tensor, rows: RecurrentRows, state: dict[str, torch.Tensor], bufs: PassBuffers
    ) -> torch.Tensor:
        """Mixer output of the normed rows ``x`` ``[T, H]`` into ``bufs.mixer_out``; updates the slots."""
        c, s = self.config, self.shard
        t = x.shape[0]
        hk, hv, dk, dv = (
            s.linear_num_key_heads,
            s.linear_num_value_heads,
            s.linear_key_head_dim,
            s.linear_value_head_dim,
        )
        proj = torch.matmul(x, self.in_proj.t(), out=bufs.gdn_proj)
        mixed, z, b, a = proj.split(self.splits, dim=-1)
        conv = self._conv(mixed, rows, state["conv"], bufs.gdn_conv)

        q, k, v = conv.split([s.key_dim, s.key_dim, s.value_dim], dim=-1)
        q = l2_normalise(q.reshape(t, hk, dk).float()) * dk**-0.5
        k = l2_normalise(k.reshape(t, hk, dk).float())
        q, k = (y.repeat_interleave(hv // hk, dim=1) for y in (q, k))
        v = v.reshape(t, hv, dv).float()
        beta = torch.sigmoid(b).float()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)

        core = bufs.gdn_core.view(t, hv, dv)
        ssm = state["ssm"]
        for (start, n), slot in rows.prefills():
            end = start + n
            o, final = chunked_delta_rule(
                q[start:end],
                k[start:end],
                v[start:end],
                g[start:end],
                beta[start:end],
                ssm.index_select(0, slot)[0],
            )
            core[start:end] = o
            ssm.index_copy_(0, slot, final.unsqueeze(0))
        if rows.num_decodes:
            d0, d1 = rows.decode_start, rows.decode_start + rows.num_decodes
            o, final = delta_rule_step(
                q[d0:d1], k[d0:d1], v[d0:d1], g[d0:d1], beta[d0:d1], ssm.index_select(0, rows.decode_slots)
            )
            core[d0:d1] = o
            ssm.index_copy_(0, rows.decode_slots, final)

        gated = gated_rms_norm(
            core, z.reshape(t, hv, dv), self.norm, c.rms_norm_eps, out=bufs.gdn_gated.view(t, hv, dv)
        )
        out = torch.matmul(gated.view(t, s.value_dim), self.out_proj.t(), out=bufs.mixer_out)
        return self.tp.all_reduce(out)  # row-parallel: the ranks' partial sums

    def _conv(
        self, mixed: torch.Tensor, rows: RecurrentRows, windows: torch.Tensor, out: torch.Tensor
    ) -> torch.Tensor:
        """Causal conv + SiLU of every row into ``out``, each request continuing from its slot's window."""
        for (start, n), slot in rows.prefills():
            y, window = causal_conv_prefill(
                mixed[start : start + n], self.conv_weight, windows.index_select(0, slot)[0]
            )
            out[start : start + n] = F.silu(y)
            windows.index_copy_(0, slot, window.unsqueeze(0).to(windows.dtype))
        if rows.num_decodes:
            d0, d1 = rows.decode_start, rows.decode_start + rows.num_decodes
            y, window = causal_conv_step(
                mixed[d0:d1], self.conv_weight, windows.index_select(0, rows.decode_slots)
            )
            out[d0:d1] = F.silu(y)
            windows.index_copy_(0, rows.decode_slots, window.to(windows.dtype))
        return out

    def load(self, reader: CheckpointReader, prefix: str) -> None:
        c, h = self.config, self.config.hidden_size
        hv, dtype = c.linear_num_value_heads, self.in_proj.dtype
        # q|k|v: each segment split by heads on its own (never an even split of the packed dimension);
        # z, b, a, dt_bias, A_log: this rank's value heads; out_proj: the matching input columns.
        qkv, heads, columns = stitch(0, c.key_dim, c.key_dim, c.value_dim), split(0), split(1)

        def get(name: str, shape: tuple[int, ...], shard: Shard | None = None) -> torch.Tensor:
            return reader.get(prefix + name, shape, dtype, shard)

        with torch.no_grad():
            self.in_proj.copy_(
                torch.cat(
                    [
                        get("in_proj_qkv.weight", (c.conv_dim, h), qkv),
                        get("in_proj_z.weight", (c.value_dim, h), heads),
                        get("in_proj_b.weight", (hv, h), heads),
                        get("in_proj_a.weight", (hv, h), heads),
                    ]
                )
            )
            self.conv_weight.copy_(get("conv1d.weight", (c.conv_dim, 1, c.conv_kernel), qkv)[:, 0])
            self.dt_bias.copy_(get("dt_bias", (hv,), heads))
            self.A_log.copy_(get("A_log", (hv,), heads))
            self.norm.copy_(get("norm.weight", (c.linear_value_head_dim,)))
            self.out_proj.copy_(get("out_proj.weight", (h, c.value_dim), columns))
