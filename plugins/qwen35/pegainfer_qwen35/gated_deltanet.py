"""The Gated DeltaNet mixer (Qwen3.5's ``linear_attention`` layers).

Per token: one GEMM for the packed input projections ``[q|k|v, z, b, a]``; a causal depthwise conv over
q|k|v whose window of the last K-1 inputs lives in the request's state slot; SiLU; q and k L2-normalised
(q also scaled by dk^-0.5); beta = sigmoid(b) and the log decay g = -exp(A_log) softplus(a + dt_bias);
the delta rule, whose state also lives in the slot; a gated RMSNorm with z; the output projection.

Prefill segments run one request at a time (chunked delta rule from the slot's state, written back at the
end of the chunk); on CUDA with fla-core installed (the plugin's ``gpu`` extra) all segments go through
fla's varlen chunked kernels in one call instead, and a step whose segments are all short, or that saves
state checkpoints inside them, takes two launches of ``gdn_kernels`` (the conv, then the recurrence token
by token with the gated norm); a long segment without checkpoints beside such segments runs apart from
them (``RecurrentRows.prefill_parts``). All decode rows of a step run as one batch: on CUDA two
launches of ``gdn_kernels`` (conv update; gating + L2 norm + delta rule + gated norm) update each row's
slot in place, addressed through the device tensor of slots (CUDA-graph safe; a step of one row leaves
the gated norm to ``out_proj``'s single-row GEMV, ``NORM_IN_OUT_PROJECTION``); elsewhere
:func:`decode_reference` gathers and scatters the slots. The padding rows of a CUDA-graph bucket replicate
row 0 (its state slot, its inputs; no cache page): the kernels and the reference alike skip a row whose slot
repeats row 0's (it reads zeros and writes nothing), so the slot is updated once, and a padding row's
values differ from row 0's as they do on the GPU.
Value head j reads q/k head ``j // (Hv / Hk)`` (consecutive heads share, as transformers does).
Qwen3-Next stores the input projections fused and grouped by key head (``in_proj_qkvz``, ``in_proj_ba``);
they are de-interleaved at load time into the same packed rows (``_defused_projections``).

Tensor parallelism splits the layer by heads: each rank holds Hk/tp key heads and Hv/tp value heads, so
local value head j reads local key head ``j // (Hv / Hk)`` as on one rank. ``in_proj_qkv`` and the conv
channels are stitched per segment (this rank's q heads | k heads | v heads; an even split of the packed
dimension would hand rank 0 all of q and part of k), ``in_proj_z/b/a``, ``dt_bias`` and ``A_log`` are split
by value heads, the gated norm's per-head weight is replicated and ``out_proj`` is row-parallel: its
partial output is all-reduced in place. The conv window and the delta-rule state are the rank's channels
and heads only; they are never reduced.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pegainfer.memory.buffer_specs import RecurrentStateSpec
from pegainfer.model.checkpoint import CheckpointReader
from pegainfer.model.model_api import ForwardBatch, StateCheckpoints
from pegainfer.ops import triton_enabled, use_triton
from pegainfer.parallel.distributed import TensorParallel
from pegainfer.parallel.sharding import Shard, split, stitch
from pegainfer_qwen35.config import Qwen35Config, Qwen35Shard, _LinearAttentionWidths
from pegainfer_qwen35.delta_rule import (
    causal_conv_prefill,
    causal_conv_step,
    chunked_delta_rule,
    conv_window_after,
    delta_rule_step,
    l2_normalise,
)
from pegainfer_qwen35.norms import gated_rms_norm
from pegainfer_qwen35.pass_buffers import PassBuffers
from pegainfer_qwen35.projections import FoldedNorm, project, project_add, takes_gated_norm

if TYPE_CHECKING:  # the kernels are imported on CUDA only (see pegainfer.ops)
    from pegainfer.kernels.skinny_gemm import GatedNorm

logger = logging.getLogger(__name__)

#: On CUDA, prefill steps whose segments are all this short run the recurrent form in Triton
#: (``gdn_kernels.gdn_prefill``, one step per token) instead of fla's chunked kernels, whose fixed host cost
#: per call dominates a short chunk (measured in docs/benchmarks.md, "Prefix caching").
RECURRENT_PREFILL_MAX_TOKENS = 128

#: The slot state of a GDN layer is kept in fp32: the delta-rule state must be, and the conv window (model-
#: dtype values) is stored exactly in fp32 so one RecurrentStateSpec holds both.
STATE_DTYPE = torch.float32


#: A decode-only step of one row applies the gated norm inside ``out_proj``'s single-row GEMV, one launch
#: fewer a GDN layer where the delta-rule kernel's programs are narrower than a head (Qwen3.5-35B-A3B's
#: batch-1 step on an H100: 3.106 / 3.106 -> 3.087 / 3.090 ms, two rounds; docs/benchmarks.md, thirtieth
#: session). ``PEGAINFER_NORM_IN_OUT_PROJECTION=0`` turns it off.
NORM_IN_OUT_PROJECTION = os.environ.get("PEGAINFER_NORM_IN_OUT_PROJECTION", "1") != "0"


def gdn_kernels_enabled() -> bool:
    """False where ``PEGAINFER_QWEN35_GDN_KERNELS=0`` (the benchmarks compare) or
    ``PEGAINFER_DISABLE_TRITON=1`` keeps the torch reference on CUDA."""
    return triton_enabled() and os.environ.get("PEGAINFER_QWEN35_GDN_KERNELS", "1") != "0"


def decode_kernels_on(x: torch.Tensor) -> bool:
    """Whether decode rows (and short prefill segments) take the fused kernels of ``gdn_kernels``: CUDA
    tensors where :func:`gdn_kernels_enabled`."""
    return x.is_cuda and gdn_kernels_enabled()


@dataclass
class RecurrentRows:
    """Where each request's tokens are in the batch and which state slot it owns."""

    segments: list[tuple[int, int]]  # (first row, length) of each prefill segment
    segment_slots: torch.Tensor  # [num_segments] int64
    decode_start: int
    num_decodes: int
    decode_slots: torch.Tensor  # [num_decodes] int64
    checkpoints: StateCheckpoints | None = None  # snapshots to take inside the segments
    in_graph: bool = False  # the segments are placeholders (a CUDA-graph step): never split

    @functools.cached_property
    def cu_seqlens_cpu(self) -> torch.Tensor:
        """The segments' bounds ``[num_segments + 1]`` int64 (the varlen form of fla's kernels), on the host."""
        return torch.tensor([0] + [start + n for start, n in self.segments], dtype=torch.int64)

    @functools.cached_property
    def cu_seqlens(self) -> torch.Tensor:
        """:attr:`cu_seqlens_cpu` on the slots' device (a CUDA-graph step's own device tensor, see
        ``from_batch``): one object every layer of the forward passes, so fla's identity-keyed caches build
        the chunk indices derived from it once per forward, not per layer."""
        return self.cu_seqlens_cpu.to(self.segment_slots.device)

    @property
    def longest_segment(self) -> int:
        return max((n for _, n in self.segments), default=0)

    @functools.cached_property
    def prefill_parts(self) -> list[tuple[int, int, RecurrentRows]]:
        """The prefill segments as (first row, end row, rows of the part) runs that each take one form.

        Checkpoints are saved only by the recurrent form (token by token), so where a step holds both
        checkpointed segments (verification chunks, a chunk crossing a caching boundary) and a long segment
        without any, the two kinds run apart: each maximal run of consecutive segments of one kind is a
        part, its rows re-based to 0. Otherwise the whole step is one part. Built once per forward."""
        ckpt = self.checkpoints
        if ckpt is None or self.in_graph:
            return [(0, self.decode_start, self)]
        saving = [tokens >= 0 and count > 0 for tokens, _, count in ckpt.host]
        lengths = [n for _, n in self.segments]
        if not any(saving) or all(
            s or n <= RECURRENT_PREFILL_MAX_TOKENS for s, n in zip(saving, lengths, strict=True)
        ):
            return [(0, self.decode_start, self)]
        parts, first = [], 0
        for i in range(1, len(self.segments) + 1):
            if i == len(self.segments) or saving[i] != saving[first]:
                parts.append(self._part(first, i, saving[first]))
                first = i
        return parts

    def _part(self, i: int, j: int, saving: bool) -> tuple[int, int, RecurrentRows]:
        """Segments ``[i, j)`` as rows of their own (re-based to their first row)."""
        lo = self.segments[i][0]
        hi = self.segments[j - 1][0] + self.segments[j - 1][1]
        ckpt = self.checkpoints
        part = RecurrentRows(
            segments=[(start - lo, n) for start, n in self.segments[i:j]],
            segment_slots=self.segment_slots[i:j],
            decode_start=hi - lo,
            num_decodes=0,
            decode_slots=self.decode_slots[:0],
            checkpoints=None
            if not saving
            else StateCheckpoints(
                ckpt.tokens[i:j], ckpt.slots[i:j], ckpt.counts[i:j], ckpt.host[i:j], ckpt.pools
            ),
        )
        return lo, hi, part

    def prefills(self) -> list[tuple[tuple[int, int], torch.Tensor]]:
        """((first row, length), slot as a 1-element index tensor) per prefill segment."""
        return [(seg, self.segment_slots[i : i + 1]) for i, seg in enumerate(self.segments)]

    @classmethod
    def from_batch(cls, batch: ForwardBatch) -> RecurrentRows:
        if batch.state_slots is None:
            raise RuntimeError("Qwen3.5 needs a state slot per request, but the batch carries none")
        meta = batch.attn
        num_segments = len(meta.prefills)
        rows = cls(
            segments=[(seg.q_start, seg.q_len) for seg in meta.prefills],
            segment_slots=batch.state_slots[:num_segments],
            decode_start=meta.num_prefill_tokens,
            num_decodes=meta.num_decodes,
            decode_slots=batch.state_slots[num_segments : num_segments + meta.num_decodes],
            checkpoints=batch.checkpoints,
            in_graph=meta.in_graph,
        )
        if meta.in_graph:  # placeholder segments: the real bounds are the graph's device tensor
            rows.cu_seqlens = meta.derived["cu_seqlens"]
        return rows


def gate_and_normalise(
    conv: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    widths: _LinearAttentionWidths,
) -> tuple[torch.Tensor, ...]:
    """The delta rule's fp32 inputs from the conv output ``[T, conv_dim]`` and b, a ``[T, Hv]``: q, k
    L2-normalised (q scaled by dk^-0.5) and repeated to the value heads ``[T, Hv, dk]``, v ``[T, Hv, dv]``,
    the log decay g and beta ``[T, Hv]``."""
    t = conv.shape[0]
    hk, hv = widths.linear_num_key_heads, widths.linear_num_value_heads
    dk, dv = widths.linear_key_head_dim, widths.linear_value_head_dim
    q, k, v = conv.split([widths.key_dim, widths.key_dim, widths.value_dim], dim=-1)
    q = l2_normalise(q.reshape(t, hk, dk).float()) * dk**-0.5
    k = l2_normalise(k.reshape(t, hk, dk).float())
    q, k = (y.repeat_interleave(hv // hk, dim=1) for y in (q, k))
    v = v.reshape(t, hv, dv).float()
    beta = torch.sigmoid(b).float()
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)
    return q, k, v, g, beta


def decode_reference(
    mixed: torch.Tensor,
    z: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    conv_weight: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    windows: torch.Tensor,
    ssm: torch.Tensor,
    slots: torch.Tensor,
    conv_out: torch.Tensor,
    out: torch.Tensor,
    *,
    num_key_heads: int,
    eps: float,
) -> torch.Tensor:
    """The torch reference of a decode step over B rows (the oracle of ``gdn_kernels``): mixed ``[B,
    conv_dim]``, z ``[B, Hv dv]``, b, a ``[B, Hv]``; the slot pools ``windows`` ``[S, conv_dim, K-1]`` and
    ``ssm`` ``[S, Hv, dk, dv]`` are gathered at ``slots``, updated and scattered back. Writes the conv
    output into ``conv_out`` and the gated-norm output into ``out`` ``[B, Hv dv]``, and returns ``out``."""
    rows = mixed.shape[0]
    _, hv, dk, dv = ssm.shape
    widths = _Widths(num_key_heads, hv, dk, dv)
    owns = _row_owners(slots)
    y, window = causal_conv_step(mixed, conv_weight, _gather_owned(windows, slots, owns))
    conv = conv_out.copy_(F.silu(y))
    _scatter_owned(windows, slots, owns, window.to(windows.dtype))
    q, k, v, g, beta = gate_and_normalise(conv, b, a, a_log, dt_bias, widths)
    o, final = delta_rule_step(q, k, v, g, beta, _gather_owned(ssm, slots, owns))
    _scatter_owned(ssm, slots, owns, final)
    core = o.to(mixed.dtype)
    gated_rms_norm(core, z.reshape(rows, hv, dv), norm_weight, eps, out=out.view(rows, hv, dv))
    return out


def _row_owners(slots: torch.Tensor) -> torch.Tensor:
    """Which decode rows own their slot, as the kernels decide (``gdn_kernels``' module docstring): a
    valid slot, and not a later row repeating row 0's (a CUDA-graph bucket's padding)."""
    row = torch.arange(slots.shape[0], device=slots.device)
    return (slots >= 0) & ((row == 0) | (slots != slots[:1]))


def _gather_owned(pool: torch.Tensor, slots: torch.Tensor, owns: torch.Tensor) -> torch.Tensor:
    """``pool[slots]``, zeros for the rows that do not own their slot (what the kernels read for them)."""
    got = pool.index_select(0, slots.clamp(min=0))
    return torch.where(owns.view(-1, *(1,) * (got.dim() - 1)), got, 0.0)


def _scatter_owned(pool: torch.Tensor, slots: torch.Tensor, owns: torch.Tensor, new: torch.Tensor) -> None:
    """``pool[slots] = new`` for the owning rows only; the others write row 0's value into row 0's slot
    again (no host sync to drop them, and no second value for that slot)."""
    mask = owns.view(-1, *(1,) * (new.dim() - 1))
    pool.index_copy_(0, torch.where(owns, slots, slots[:1]), torch.where(mask, new, new[:1]))


@dataclass(frozen=True)
class _Widths(_LinearAttentionWidths):
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int


_FLA: list = []


def fla_chunk_rule():
    """fla's ``chunk_gated_delta_rule`` when fla-core is installed (the qwen35 plugin's ``gpu`` extra),
    else None; ``PEGAINFER_QWEN35_FLA=0`` turns it off."""
    if os.environ.get("PEGAINFER_QWEN35_FLA", "1") == "0":
        return None
    if not _FLA:
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        except Exception:  # not installed, or it fails to import on this stack: the torch chunked form
            chunk_gated_delta_rule = None
        version = _fla_version()
        if chunk_gated_delta_rule is not None and version not in FLA_VERSIONS:
            # Its keyword options (the gate and beta in the kernel) are read through **kwargs: a version
            # that ignored them would compute something else without an error.
            logger.warning("fla-core %s is not one prefill was checked with (%s): the torch chunked form runs",
                           version, ", ".join(FLA_VERSIONS))  # fmt: skip
            chunk_gated_delta_rule = None
        _FLA.append(chunk_gated_delta_rule)
    return _FLA[0]


#: fla-core versions ``prefill_with_fla`` is written and tested against (the plugin's ``gpu`` extra pins one).
FLA_VERSIONS = ("0.6.0",)


def _fla_version() -> str | None:
    try:
        return importlib.metadata.version("fla-core")
    except importlib.metadata.PackageNotFoundError:
        return None


def prefill_with_fla(
    conv: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    rows: RecurrentRows,
    ssm: torch.Tensor,
    widths: _LinearAttentionWidths,
    core: torch.Tensor,
    rule=None,
) -> bool:
    """The chunked delta rule of every prefill segment in one varlen call of fla's kernels (CUDA only),
    from and back into the segments' slots; writes ``core`` ``[P, Hv, dv]``. False (nothing done) where
    fla is not available: the caller runs the torch chunked form. ``rule``: a stand-in with fla's
    signature, on any device (the tests)."""
    rule = rule or (fla_chunk_rule() if conv.is_cuda else None)
    if rule is None:
        return False
    p = conv.shape[0]
    hk, hv = widths.linear_num_key_heads, widths.linear_num_value_heads
    dk, dv = widths.linear_key_head_dim, widths.linear_value_head_dim
    q, k, v = conv.split([widths.key_dim, widths.key_dim, widths.value_dim], dim=-1)
    try:
        # fla takes fewer q/k heads than value heads (value head j reads q/k head j // (hv / hk)), the raw
        # decay input and beta logits (the gate, softplus and sigmoid in its kernels), and the segments'
        # bounds on the host as well (no device sync to build its chunk indices).
        o, final = rule(
            q.reshape(1, p, hk, dk), k.reshape(1, p, hk, dk), v.reshape(1, p, hv, dv), g=a.unsqueeze(0),
            beta=b.unsqueeze(0), scale=dk**-0.5, initial_state=ssm.index_select(0, rows.segment_slots),
            output_final_state=True, cu_seqlens=rows.cu_seqlens, cu_seqlens_cpu=rows.cu_seqlens_cpu,
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=a_log, dt_bias=dt_bias,
            use_beta_sigmoid_in_kernel=True,
        )  # fmt: skip
    except Exception as exc:  # an fla version whose API differs: say so once, keep the torch form
        logger.warning("fla's chunk_gated_delta_rule failed (%r); prefill uses the torch chunked form", exc)
        _FLA[0] = None
        return False
    core.copy_(o[0])
    ssm.index_copy_(0, rows.segment_slots, final.to(ssm.dtype))
    return True


def _conv_segment(
    x: torch.Tensor,
    weight: torch.Tensor,
    window: torch.Tensor,
    out: torch.Tensor,
    windows: torch.Tensor,
    slot: torch.Tensor,
) -> None:
    """One prefill segment's causal conv and SiLU into ``out``, its new window into slot ``slot`` of
    ``windows``. A function of its own so that the conv's temporaries are freed before the delta rule
    runs (``pass_buffers.kernel_scratch`` bounds the two apart)."""
    y, window = causal_conv_prefill(x, weight, window)
    out.copy_(F.silu(y))
    windows.index_copy_(0, slot, window.unsqueeze(0).to(windows.dtype))


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

    @property
    def first_projection(self) -> torch.Tensor:
        """The projection of the layer's input rows (``in_proj``), which carries the input norm folded in."""
        return self.in_proj

    def forward(
        self,
        x: torch.Tensor,
        rows: RecurrentRows,
        state: dict[str, torch.Tensor],
        bufs: PassBuffers,
        residual: torch.Tensor | None = None,
        norm: FoldedNorm | None = None,
    ) -> torch.Tensor:
        """Mixer output of the normed rows ``x`` ``[T, H]`` (with ``norm``: of the un-normed rows, the
        norm folded into ``in_proj``; into ``bufs.mixer_out`` on the reference path); updates the slots.
        With ``residual`` the output is added to it in place (inside the GEMM where the skinny kernel
        runs) and ``residual`` is returned."""
        s = self.shard
        proj = project(x, self.in_proj, bufs.gdn_proj, norm)
        mixed, z, b, a = proj.split(self.splits, dim=-1)
        gated = bufs.gdn_gated
        norm_after = self._norm_in_out_projection(x, z, rows, residual, gated)
        if rows.segments:
            self._prefill_segments(mixed, z, b, a, rows, state, bufs)
        if rows.num_decodes:
            d = slice(rows.decode_start, rows.decode_start + rows.num_decodes)
            self._decode(
                mixed[d], z[d], b[d], a[d], rows.decode_slots, state, bufs.gdn_conv[d], gated[d],
                norm=norm_after is None,
            )  # fmt: skip
        gated = gated.view(-1, s.value_dim)
        if residual is not None:
            return project_add(gated, self.out_proj, residual, bufs.mixer_out, self.tp, norm_after)
        return self.tp.all_reduce(project(gated, self.out_proj, bufs.mixer_out))  # row-parallel partials

    def _norm_in_out_projection(
        self,
        x: torch.Tensor,
        z: torch.Tensor,
        rows: RecurrentRows,
        residual: torch.Tensor | None,
        gated: torch.Tensor,
    ) -> GatedNorm | None:
        """The decode row's gated norm as ``out_proj``'s prologue (``skinny_gemm.GatedNorm``), where a
        decode-only step of one row adds ``out_proj`` to the residual in the single-row GEMV, the kernels
        run and ``NORM_IN_OUT_PROJECTION``; else None (the delta-rule kernels apply the norm)."""
        if not (
            NORM_IN_OUT_PROJECTION
            and residual is not None
            and not rows.segments
            and rows.num_decodes == x.shape[0]
            and decode_kernels_on(x)
            and takes_gated_norm(gated[: x.shape[0]].view(x.shape[0], -1), self.out_proj, self.tp)
        ):
            return None
        from pegainfer.kernels.skinny_gemm import GatedNorm

        return GatedNorm(z, self.norm, self.config.rms_norm_eps)

    def _decode(
        self,
        mixed: torch.Tensor,
        z: torch.Tensor,
        b: torch.Tensor,
        a: torch.Tensor,
        slots: torch.Tensor,
        state: dict[str, torch.Tensor],
        conv_out: torch.Tensor,
        out: torch.Tensor,
        norm: bool = True,
    ) -> None:
        """One token per decode row: conv, gating, delta rule and gated norm into ``out`` ``[B, value_dim]``,
        each row's slot updated in place. On CUDA the two kernels of ``gdn_kernels`` (graph-safe: the
        slots are read on the device); without ``norm`` (kernels only) ``out`` gets the output before the
        gated norm, which ``out_proj`` then applies; elsewhere :func:`decode_reference`."""
        eps, hk = self.config.rms_norm_eps, self.shard.linear_num_key_heads
        if decode_kernels_on(mixed):
            from pegainfer_qwen35 import gdn_kernels

            gdn_kernels.conv_update(mixed, self.conv_weight, state["conv"], slots, conv_out)
            gdn_kernels.gdn_decode(
                conv_out, b, a, z, self.A_log, self.dt_bias, self.norm, state["ssm"], slots, out,
                num_key_heads=hk, eps=eps, norm=norm,
            )  # fmt: skip
            return
        if not norm:
            raise ValueError("GatedDeltaNet: the gated norm is left to out_proj only on the kernels")
        decode_reference(
            mixed, z, b, a, self.conv_weight, self.A_log, self.dt_bias, self.norm,
            state["conv"], state["ssm"], slots, conv_out, out, num_key_heads=hk, eps=eps,
        )  # fmt: skip

    def _prefill_segments(
        self,
        mixed: torch.Tensor,
        z: torch.Tensor,
        b: torch.Tensor,
        a: torch.Tensor,
        rows: RecurrentRows,
        state: dict[str, torch.Tensor],
        bufs: PassBuffers,
    ) -> None:
        """The prefill rows ``[0, P)``, part by part (:attr:`RecurrentRows.prefill_parts`), into the
        pass buffers' ``gdn_conv``, ``gdn_core`` and ``gdn_gated`` rows."""
        for lo, hi, part in rows.prefill_parts:
            self._prefill(
                mixed[lo:hi], z[lo:hi], b[lo:hi], a[lo:hi], part, state, bufs.gdn_conv[lo:hi],
                bufs.gdn_core[lo:hi], bufs.gdn_gated[lo:hi],
            )  # fmt: skip

    def _prefill(
        self,
        mixed: torch.Tensor,
        z: torch.Tensor,
        b: torch.Tensor,
        a: torch.Tensor,
        rows: RecurrentRows,
        state: dict[str, torch.Tensor],
        conv: torch.Tensor,
        core: torch.Tensor,
        gated: torch.Tensor,
    ) -> None:
        """The prefill segments of ``rows`` (the inputs' rows ``[0, P)``, one part of
        :attr:`RecurrentRows.prefill_parts`): conv from each slot's window into ``conv``, the chunked delta
        rule from its state into ``core`` (fla's kernels on CUDA when installed), the gated norm into
        ``gated``; the checkpoints of ``rows`` (snapshots inside segments) saved on the way."""
        s, eps = self.shard, self.config.rms_norm_eps
        hv, dv = s.linear_num_value_heads, s.linear_value_head_dim
        windows, ssm = state["conv"], state["ssm"]
        p = rows.decode_start
        conv = conv[:p]
        ckpt = rows.checkpoints
        snaps = ckpt.pools[self.layer_index] if ckpt is not None else None
        # Short chunks (a prompt's tail after a prefix hit, chunked-prefill remainders): two launches. So
        # are parts with checkpoints, which only the recurrent form saves (a long chunk without any runs
        # as a part of its own, see ``prefill_parts``).
        if decode_kernels_on(mixed) and (rows.longest_segment <= RECURRENT_PREFILL_MAX_TOKENS or ckpt):
            from pegainfer_qwen35 import gdn_kernels

            def at(pool: str) -> gdn_kernels.Checkpoints | None:
                if ckpt is None:
                    return None
                return gdn_kernels.Checkpoints(ckpt.tokens, ckpt.slots, ckpt.counts, snaps[pool])

            gdn_kernels.conv_prefill(
                mixed[:p], self.conv_weight, windows, rows.segment_slots, rows.cu_seqlens, conv, at("conv")
            )
            gdn_kernels.gdn_prefill(
                conv, b[:p], a[:p], z[:p], self.A_log, self.dt_bias, self.norm, ssm, rows.segment_slots,
                rows.cu_seqlens, gated[:p], num_key_heads=s.linear_num_key_heads, eps=eps,
                checkpoints=at("ssm"),
            )  # fmt: skip
            return
        saves = ckpt.host if ckpt is not None else [(-1, -1, 0)] * len(rows.segments)
        # Per segment: its first snapshot slot and the token counts after which the state goes into it and
        # the slots after it (none past the segment's end).
        cuts = [
            (snap, [tokens + j for j in range(count) if tokens >= 0 and tokens + j <= n])
            for (_, n), (tokens, snap, count) in zip(rows.segments, saves, strict=True)
        ]
        for ((start, n), slot), (snap, after) in zip(rows.prefills(), cuts, strict=True):
            window = windows.index_select(0, slot)[0]
            for j, tokens in enumerate(after):  # the window after the first ``tokens`` inputs
                snaps["conv"][snap + j] = conv_window_after(mixed[start : start + tokens], window)
            _conv_segment(
                mixed[start : start + n], self.conv_weight, window, conv[start : start + n], windows, slot
            )
        core = core[:p].view(p, hv, dv)
        if ckpt is not None or not prefill_with_fla(
            conv, b[:p], a[:p], self.A_log, self.dt_bias, rows, ssm, s, core
        ):
            q, k, v, g, beta = gate_and_normalise(conv, b[:p], a[:p], self.A_log, self.dt_bias, s)
            for ((start, n), slot), (snap, after) in zip(rows.prefills(), cuts, strict=True):
                # The checkpoints split the segment: the state after each piece is saved, then carried on.
                carried = ssm.index_select(0, slot)[0]
                lo = start
                for j, hi in enumerate([start + tokens for tokens in after] + [start + n]):
                    if hi > lo:  # no empty piece (a save before the segment, or at its end)
                        o, carried = chunked_delta_rule(
                            q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], carried
                        )
                        core[lo:hi] = o
                    if j < len(after):
                        snaps["ssm"][snap + j] = carried
                    lo = hi
                ssm.index_copy_(0, slot, carried.unsqueeze(0))
        out = gated[:p].view(p, hv, dv)
        z = z[:p].reshape(p, hv, dv)
        if use_triton(core):
            from pegainfer_qwen35 import gdn_kernels

            gdn_kernels.gated_rms_norm(core, z, self.norm, eps, out)
        else:
            gated_rms_norm(core, z, self.norm, eps, out=out)

    def load(self, reader: CheckpointReader, prefix: str) -> None:
        c, h = self.config, self.config.hidden_size
        hv, dtype = c.linear_num_value_heads, self.in_proj.dtype
        # q|k|v: each segment split by heads on its own (never an even split of the packed dimension);
        # z, b, a, dt_bias, A_log: this rank's value heads; out_proj: the matching input columns.
        qkv, heads, columns = stitch(0, c.key_dim, c.key_dim, c.value_dim), split(0), split(1)

        def get(name: str, shape: tuple[int, ...], shard: Shard | None = None) -> torch.Tensor:
            return reader.get(prefix + name, shape, dtype, shard)

        with torch.no_grad():
            if c.fused_gdn_projections:
                self.in_proj.copy_(self._defused_projections(reader, prefix))
            else:
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

    def _defused_projections(self, reader: CheckpointReader, prefix: str) -> torch.Tensor:
        """Qwen3-Next's ``in_proj_qkvz`` and ``in_proj_ba`` in this layer's ``[q|k|v, z, b, a]`` rows.

        Both are stored grouped by key head: group g holds ``[q_g (dk), k_g (dk), v_g (r dv), z_g (r dv)]``
        and ``[b_g (r), a_g (r)]`` for its ``r = Hv / Hk`` value heads ``g r .. g r + r - 1``. The groups
        are consecutive, so an even split of the rows hands each rank whole groups: its key heads and
        exactly the value heads that read them, the heads ``dt_bias``/``A_log``/``out_proj`` are split by.
        Each rank's rows are then de-interleaved into one q block, one k block, ... of its own heads.
        """
        c, h, dtype = self.config, self.config.hidden_size, self.in_proj.dtype
        hk_full, hv_full = c.linear_num_key_heads, c.linear_num_value_heads
        dk, dv, r = c.linear_key_head_dim, c.linear_value_head_dim, hv_full // hk_full
        hk = self.shard.linear_num_key_heads  # this rank's groups
        qkvz = reader.get(
            prefix + "in_proj_qkvz.weight", (2 * c.key_dim + 2 * c.value_dim, h), dtype, split(0)
        )
        ba = reader.get(prefix + "in_proj_ba.weight", (2 * hv_full, h), dtype, split(0))
        q, k, v, z = qkvz.view(hk, 2 * dk + 2 * r * dv, h).split([dk, dk, r * dv, r * dv], dim=1)
        b, a = ba.view(hk, 2 * r, h).split([r, r], dim=1)
        return torch.cat([t.reshape(-1, h) for t in (q, k, v, z, b, a)])
