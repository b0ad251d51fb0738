"""Qwen3.5-MoE's sparse block: softmax router, top-k renormalised, SwiGLU experts, gated shared expert.

1. ``p = softmax(x Wg^T)`` over all experts in fp32; the top-k by p, renormalised to sum to 1 (always
   for Qwen3.5, which has no ``norm_topk_prob`` switch; for Qwen3-Next only under ``norm_topk_prob``),
   cast to the model dtype (``routing.softmax_topk``: one launch on CUDA).
2. Each chosen expert runs on its tokens; its output is scaled by the token's weight and summed per token.
3. ``sigmoid(shared_expert_gate(x)) * SharedExpert(x)`` is added (one scalar gate per token).

The shared expert is routed experts too: its intermediate features are cut into ``m`` pieces of the routed
experts' width (``Qwen35Shard.shared_pieces``; the last piece zero-padded, whose features then add
``silu(0) · 0 = 0``), stacked after the ``E`` routed experts, and every token chooses all ``m`` with weight
``sigmoid(gate)`` (``softmax_topk`` appends those ``m`` columns): a SwiGLU is a sum over its features, so
the pieces add up to the shared expert's output. One expert kernel then runs routed and shared alike, where
the shared expert cost two GEMM launches of its own and the combine a gated add (at decode, two of the
block's eight launches). transformers' Qwen3.5-MoE and Qwen3-Next defaults (the 35B-A3B and 80B-A3B
styles) have ``m = 1``: 512 features each.

The checkpoint stores experts one by one; they are stacked at load time (``[E + m, 2Ie, H]``, gate rows
first, and ``[E + m, H, Ie]``). The router and the shared expert's one-row gate are one GEMM (``router``:
``[E + 1, H]``, the gate last). On CUDA every step's experts go through ``ops.fused_moe`` (Triton kernels
over the chosen experts only: a decode step's few tokens one (token, choice) pair at a time, more as
grouped GEMMs; no host sync, so the decode graphs capture it and eager and graph decode compute the same);
at tp=1 the residual add rides its combining launch. Elsewhere the reference forward has two
schedules with the same sums (the choices added in order, the shared pieces last, as transformers adds the
shared expert after the routed ones):
- grouped (steps with prefill tokens): the (token, expert) pairs are sorted by expert and each expert
  runs one GEMM over its rows; the row counts are read on the host.
- static (decode-only steps, which the engine captures in CUDA graphs): no host sync and shapes fixed by
  T; every expert runs on every row and rows that did not choose it are weighted by zero.

Tensor parallelism splits the intermediate features, not the experts: every rank holds every expert with
Ie/tp of its features (gate/up rows, the matching down columns) and the shared expert split the same way
(before it is cut into pieces), while the router and ``shared_expert_gate`` are replicated, so every rank
routes the same tokens to the same experts. The per-token weights are scalars per row, so they scale the
partial sums as they would the whole one, and the block's sum is all-reduced once at the end.
Why not expert parallel: here every rank does the same work whatever the routing (with whole experts a
skewed batch loads one rank), the static decode schedule keeps its shapes (every rank runs its share of
every expert on every row, so the CUDA graphs capture the same launches), and there is one all-reduce of
``[T, H]`` a layer and no all-to-all of the routed rows.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from pegainfer import ops
from pegainfer.model.checkpoint import CheckpointReader
from pegainfer.parallel.distributed import TensorParallel
from pegainfer.parallel.sharding import Shard, split, stitch
from pegainfer_qwen35.config import Qwen35Config, Qwen35Shard
from pegainfer_qwen35.norms import rms_norm_zero_centred
from pegainfer_qwen35.pass_buffers import PassBuffers
from pegainfer_qwen35.routing import softmax_topk

#: A decode row whose router takes the preloading GEMV has that GEMV apply the block's norm (and write
#: the normed row for the experts), one launch fewer a MoE layer: 35B-A3B batch 1 3.049 / 3.04 ->
#: 3.03 / 3.01 ms on an H100 (docs/benchmarks.md, thirty-first session). ``PEGAINFER_MOE_NORM_IN_ROUTER=0``
#: turns it off.
MOE_NORM_IN_ROUTER = os.environ.get("PEGAINFER_MOE_NORM_IN_ROUTER", "1") != "0"


def _router_logits(x: torch.Tensor, router: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``x @ router.T``: a single row on CUDA through the preloading GEMV (launched early, its weights
    loaded before it waits for the norm before it), else into ``out``."""
    if ops.use_triton(x):
        from pegainfer.kernels import skinny_gemm  # CUDA only (see pegainfer.ops)

        if skinny_gemm.takes_preload(x, router):
            return skinny_gemm.gemv_preload_triton(x, router)
    return torch.matmul(x, router.t(), out=out)


def _norm_in_router(x: torch.Tensor, router: torch.Tensor) -> bool:
    """Whether the router's GEMV of ``x`` can apply the block's norm first (``MOE_NORM_IN_ROUTER``, one
    row through the preloading GEMV, the hidden size one slice wide)."""
    if not (MOE_NORM_IN_ROUTER and ops.use_triton(x)):
        return False
    from pegainfer.kernels import skinny_gemm  # CUDA only (see pegainfer.ops)

    return skinny_gemm.takes_preload(x, router) and x.shape[-1] == skinny_gemm.PRELOAD_K_SPAN


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class SparseMoE(nn.Module):
    def __init__(
        self,
        config: Qwen35Config,
        dtype: torch.dtype,
        shard: Qwen35Shard | None = None,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.tp = tp or TensorParallel()
        self.shard = s = shard or Qwen35Shard.of(config, self.tp)
        h, e = config.hidden_size, config.num_experts
        ie = s.moe_intermediate_size  # this rank's features
        #: Rows ``[0, E)``: the router; row E: the shared expert's gate (one GEMM for both).
        self.router = _param(e + 1, h, dtype=dtype)
        #: Experts ``[0, E)``: the routed ones; ``[E, E + m)``: the shared expert's pieces.
        self.experts_gate_up = _param(e + s.shared_pieces, 2 * ie, h, dtype=dtype)
        self.experts_down = _param(e + s.shared_pieces, h, ie, dtype=dtype)

    def route(
        self,
        x: torch.Tensor,
        bufs: PassBuffers,
        norm: torch.Tensor | None = None,
        real_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the normed rows, weights ``[T, k + m]`` in the model dtype, expert ids ``[T, k + m]``: the top
        k, then the shared expert's ``m`` pieces) for the normed rows ``x``, or with ``norm`` (the block's
        zero-centred norm weight) for the rows ``x`` before it: the norm goes into ``bufs.normed``, from
        inside the router's GEMV where :func:`_norm_in_router`, else as a launch of its own.
        ``real_rows``: a prefill graph's padding starts there, and its rows take row 0's selection
        (``routing``)."""
        c = self.config
        if norm is not None and _norm_in_router(x, self.router):
            from pegainfer.kernels import skinny_gemm  # CUDA only (see pegainfer.ops)

            normed = bufs.normed[: x.shape[0]]
            row_norm = skinny_gemm.RowNorm(norm, c.rms_norm_eps, normed)
            logits = skinny_gemm.gemv_preload_triton(x, self.router, row_norm=row_norm)
        else:
            normed = x if norm is None else rms_norm_zero_centred(x, norm, c.rms_norm_eps, out=bufs.normed)
            logits = _router_logits(normed, self.router, bufs.moe_router)
        weights, ids = softmax_topk(
            logits, c.num_experts_per_tok, c.norm_topk_prob, x.dtype, self.shard.shared_pieces, real_rows
        )
        return normed, weights, ids

    def forward(
        self,
        x: torch.Tensor,
        bufs: PassBuffers,
        *,
        static_shapes: bool = False,
        residual: torch.Tensor | None = None,
        norm: torch.Tensor | None = None,
        real_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Block output of the normed rows ``x`` ``[T, H]`` (into ``bufs.mlp_down`` off CUDA); with
        ``residual`` it is added to it in place and ``residual`` returned. With ``norm`` (the block's
        zero-centred norm weight) ``x`` is the rows before the norm (see :meth:`route`).

        ``static_shapes``: no host sync and no data-dependent shapes (the schedule for CUDA graphs).
        ``real_rows``: a prefill graph's padding starts there; its rows take row 0's experts (their
        outputs are discarded; they read no expert the real rows do not).
        """
        x, weights, experts = self.route(x, bufs, norm, real_rows)
        if ops.use_triton(x):
            # At tp=1, where no all-reduce comes between, the residual add rides the launch that sums the
            # choices.
            into = residual if residual is not None and self.tp.size == 1 else None
            y = ops.fused_moe(x, weights, experts, self.experts_gate_up, self.experts_down, residual=into)
            if into is not None:
                return into
        else:
            y = bufs.mlp_down
            if static_shapes:
                self._experts_static(x, weights, experts, bufs, y.zero_())
            else:
                self._experts_grouped(x, weights, experts, bufs, y)  # writes every row of y
        y = self.tp.all_reduce(y)  # the ranks' partial sums, once
        return y if residual is None else residual.add_(y)

    def _expert(
        self, expert: int, rows: torch.Tensor, gate_up: torch.Tensor, act: torch.Tensor, out: torch.Tensor
    ) -> None:
        gate, up = torch.matmul(rows, self.experts_gate_up[expert].t(), out=gate_up).chunk(2, -1)
        torch.mul(F.silu(gate), up, out=act)
        torch.matmul(act, self.experts_down[expert].t(), out=out)

    def _experts_grouped(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        experts: torch.Tensor,
        bufs: PassBuffers,
        y: torch.Tensor,
    ) -> None:
        (t, h), (_, k) = x.shape, experts.shape
        ie, num_experts = self.shard.moe_intermediate_size, self.experts_down.shape[0]
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)  # (token, choice) pairs grouped by expert
        token_of = order // k
        rows = torch.index_select(x, 0, token_of, out=bufs.moe_rows.view(t * k, h))
        gate_up = bufs.moe_gate_up.view(t * k, 2 * ie)
        act = bufs.moe_act.view(t * k, ie)
        out = bufs.moe_out.view(t * k, h)
        start = 0
        # The per-expert row counts decide the GEMM shapes: the host sync of this schedule.
        for expert, n in enumerate(torch.bincount(flat, minlength=num_experts).tolist()):
            if n:
                rs = slice(start, start + n)
                self._expert(expert, rows[rs], gate_up[rs], act[rs], out[rs])
                start += n
        out.mul_(weights.flatten()[order].unsqueeze(-1))
        # Back to (token, choice) order, then a sum over the choices: deterministic, where index_add_'s
        # float atomics on CUDA add in a different order each run (and greedy tokens drift apart).
        by_choice = rows.index_copy_(0, order, out)
        torch.sum(by_choice.view(t, k, h), dim=1, out=y)

    def _experts_static(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        experts: torch.Tensor,
        bufs: PassBuffers,
        y: torch.Tensor,
    ) -> None:
        t, h = x.shape
        ie, num_experts = self.shard.moe_intermediate_size, self.experts_down.shape[0]
        shape, dev = (t, num_experts), x.device
        dense = torch.zeros(shape, dtype=weights.dtype, device=dev).scatter_(1, experts, weights)
        skipped = torch.ones(shape, dtype=torch.bool, device=dev).scatter_(1, experts, False)
        gate_up = bufs.moe_gate_up.view(-1, 2 * ie)[:t]
        act = bufs.moe_act.view(-1, ie)[:t]
        out = bufs.moe_out.view(-1, h)[:t]
        for expert in range(num_experts):
            self._expert(expert, x, gate_up, act, out)
            # Masked, not only weighted by 0: an unchosen row's output may be inf, and inf * 0 is NaN.
            y.add_(out.mul_(dense[:, expert : expert + 1]).masked_fill_(skipped[:, expert : expert + 1], 0.0))

    def load(self, reader: CheckpointReader, prefix: str) -> None:
        c, dtype = self.config, self.router.dtype
        h, e = c.hidden_size, c.num_experts
        ie, is_ = c.moe_intermediate_size, c.shared_expert_intermediate_size  # the checkpoint's full sizes
        # Intermediate split: this rank's gate and up rows, the matching down columns; router and shared
        # gate replicated.
        rows, columns = split(0), split(1)

        def get(name: str, shape: tuple[int, ...], shard: Shard | None = None) -> torch.Tensor:
            return reader.get(prefix + name, shape, dtype, shard)

        with torch.no_grad():
            self.router.copy_(
                torch.cat([get("gate.weight", (e, h)), get("shared_expert_gate.weight", (1, h))])
            )
            if prefix + "experts.gate_up_proj" in reader:  # stacked already (transformers' in-memory layout)
                # [E, gate | up, H]: the gate and the up rows each split on their own.
                self.experts_gate_up.copy_(get("experts.gate_up_proj", (e, 2 * ie, h), stitch(1, ie, ie)))
                self.experts_down.copy_(get("experts.down_proj", (e, h, ie), split(2)))
            else:  # one expert at a time, as the published checkpoints store them
                for i in range(e):
                    p = f"experts.{i}."
                    self.experts_gate_up[i].copy_(
                        torch.cat(
                            [
                                get(p + "gate_proj.weight", (ie, h), rows),
                                get(p + "up_proj.weight", (ie, h), rows),
                            ]
                        )
                    )
                    self.experts_down[i].copy_(get(p + "down_proj.weight", (h, ie), columns))
            self._load_shared(
                get("shared_expert.gate_proj.weight", (is_, h), rows),
                get("shared_expert.up_proj.weight", (is_, h), rows),
                get("shared_expert.down_proj.weight", (h, is_), columns),
            )

    def _load_shared(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        """This rank's shared expert (gate and up ``[Is, H]``, down ``[H, Is]``) as its ``m`` pieces of ``Ie``
        features after the routed experts, the last zero-padded."""
        e, m, ie = self.config.num_experts, self.shard.shared_pieces, self.shard.moe_intermediate_size
        pad = m * ie - gate.shape[0]
        gate, up, down = F.pad(gate, (0, 0, 0, pad)), F.pad(up, (0, 0, 0, pad)), F.pad(down, (0, pad))
        h = down.shape[0]
        self.experts_gate_up[e:].copy_(torch.cat([gate.view(m, ie, h), up.view(m, ie, h)], dim=1))
        self.experts_down[e:].copy_(down.view(h, m, ie).transpose(0, 1))
