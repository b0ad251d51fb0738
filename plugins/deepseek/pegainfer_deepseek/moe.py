"""DeepSeek-V3 feed-forward blocks: the dense SwiGLU of the first layers and the routed MoE of the rest.

Routing ("noaux_tc"): sigmoid scores per expert; the selection adds ``e_score_correction_bias`` and is
group-limited (rank groups by the sum of their two best biased scores, keep ``topk_group`` groups, then
take the top ``num_experts_per_tok`` experts inside them); the weights are the *unbiased* scores of the
chosen experts, renormalised when ``norm_topk_prob`` and multiplied by ``routed_scaling_factor``. The
router runs in fp32 whatever the model dtype (its weights are fp32 in the real checkpoint).

Tensor parallelism splits every expert's intermediate features (``moe_intermediate_size / tp`` per rank:
gate and up split along dim 0, down along dim 1), not the experts themselves. Every rank then routes
the same (replicated) tokens with the same replicated router and runs the same loop over the chosen
experts on its slice, so the work per rank is ``1 / tp`` of the block's whatever the routing does, and
no token has to move between ranks. Expert parallelism (``n_routed_experts / tp`` whole experts per
rank) would need the same single all-reduce here, but its load follows the routing: a rank whose experts
are popular in a batch does more of the work while the others wait at the collective. The shared
experts are split the same way, and the block returns this rank's partial sum of routed + shared
output: the decoder layer all-reduces it once (``DecoderLayer.forward``), as it does the dense SwiGLU's.
"""

from __future__ import annotations

import torch
from torch import nn

from pegainfer import ops
from pegainfer.errors import CheckpointError
from pegainfer.layers.activation import interleave_gate_up
from pegainfer.layers.block_fp8 import BlockFP8Weight
from pegainfer.layers.moe import BlockScales, swiglu
from pegainfer.parallel.distributed import TensorParallel
from pegainfer.parallel.sharding import Shard, split
from pegainfer_deepseek.config import DeepseekV3Dims
from pegainfer_deepseek.fp8 import WeightReader, load_projection, quantize_from
from pegainfer_deepseek.params import param, projection
from pegainfer_deepseek.routing import TopkRule, group_limited_topk


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up packed into one weight. Without ``limit`` (V3)
    the packed rows alternate gate, up (``interleave_gate_up``), so on CUDA decode rows the activation
    runs in the GEMM's epilogue (``ops.linear_silu``); with it (V4, whose gate is capped and up clamped
    first) gate rows come first.

    Under tensor parallelism (``tp``) the rank holds ``intermediate / tp`` features (gate and up split
    along dim 0, down along dim 1) and ``forward`` returns its partial output: the caller all-reduces.

    With ``fp8_block`` both weights are block FP8 (``BlockFP8Weight``: a checkpoint's float8 values, or
    plain ones quantized at load); ``fp8_checkpoint``: they come from an FP8 checkpoint, whose tiles need
    not start at this rank's first feature; ``fp8_activations``: their GEMMs quantize the activations too
    (W8A8)."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        dtype: torch.dtype,
        limit: float | None = None,
        *,
        tp: TensorParallel | None = None,
        what: str = "intermediate_size",
        fp8_block: tuple[int, int] | None = None,
        fp8_checkpoint: bool = False,
        fp8_activations: bool = False,
    ) -> None:
        super().__init__()
        tp = tp or TensorParallel()
        self.intermediate = intermediate
        self.local = local = tp.split(intermediate, what)
        self.limit = limit
        self.gate_up_proj = projection(2 * local, hidden, dtype, fp8_block, fp8_activations=fp8_activations)
        # down's columns are this rank's features: a checkpoint's tiles need not start at the first one.
        offset = tp.rank * local % fp8_block[1] if fp8_block is not None and fp8_checkpoint else 0
        self.down_proj = projection(hidden, local, dtype, fp8_block, offset, fp8_activations)

    @property
    def interleaved(self) -> bool:
        return self.limit is None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """With ``residual`` (the caller's own tensor, which may be overwritten), ``residual + SwiGLU(x)``:
        on CUDA decode rows the add runs in the down projection's epilogue."""
        if not self.interleaved:
            out = swiglu(x, self.gate_up_proj, self.down_proj, self.limit, linear=ops.linear)
            return out if residual is None else residual + out
        act = ops.linear_silu(x, self.gate_up_proj)
        return (
            ops.linear(act, self.down_proj)
            if residual is None
            else ops.linear_add(act, self.down_proj, residual)
        )

    def load(self, reader: WeightReader, prefix: str) -> None:
        i, h = self.intermediate, self.down_proj.shape[0]
        load_projection(reader, self.down_proj, prefix + "down_proj.weight", (h, i), split(1))
        if isinstance(self.gate_up_proj, BlockFP8Weight):
            # gate's rows first, then up's: interleaved as the plain weight is, scales with their rows.
            gate_up = self.gate_up_proj
            halves = [slice(0, self.local), slice(self.local, 2 * self.local)]
            for name, rows in zip(("gate_proj", "up_proj"), halves, strict=True):
                load_projection(reader, gate_up, f"{prefix}{name}.weight", (i, h), split(0), rows)
            if self.interleaved:
                gate_up.load_rows(
                    slice(0, 2 * self.local),
                    interleave_gate_up(*gate_up.weight.chunk(2)),
                    interleave_gate_up(*gate_up.scale.chunk(2)),
                )
            return
        dtype = self.gate_up_proj.dtype
        with torch.no_grad():
            gate = reader.get(prefix + "gate_proj.weight", (i, h), dtype, split(0))
            up = reader.get(prefix + "up_proj.weight", (i, h), dtype, split(0))
            self.load_gate_up(gate, up)

    def load_gate_up(self, gate: torch.Tensor, up: torch.Tensor) -> None:
        """This rank's ``gate`` and ``up`` rows ``[local, hidden]`` into the packed weight's layout."""
        with torch.no_grad():
            if self.interleaved:
                self.gate_up_proj.copy_(interleave_gate_up(gate, up))
            else:
                self.gate_up_proj.copy_(torch.cat([gate, up]))


class GroupLimitedRouter(nn.Module):
    def __init__(self, dims: DeepseekV3Dims) -> None:
        super().__init__()
        self.dims = dims
        self.weight = param(dims.n_routed_experts, dims.hidden_size, dtype=torch.float32)
        self.e_score_correction_bias = param(dims.n_routed_experts, dtype=torch.float32)
        self.rule = TopkRule(
            dims.n_group,
            dims.topk_group,
            dims.num_experts_per_tok,
            dims.norm_topk_prob,
            dims.routed_scaling_factor,
        )

    def forward(
        self, x: torch.Tensor, real_rows: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights ``[T, k]`` fp32, expert ids ``[T, k]``) for the tokens ``x`` ``[T, H]`` (``routing``: the
        selection in one Triton launch on CUDA, the torch reference elsewhere; ``real_rows``: the rows
        from there on are padding, which take row 0's). The logits are fp32: on CUDA decode rows the
        skinny GEMM upcasts x in its loop."""
        logits = ops.linear(x, self.weight)
        return group_limited_topk(logits, self.e_score_correction_bias, self.rule, real_rows)

    def load(self, reader: WeightReader, prefix: str) -> None:
        with torch.no_grad():
            self.weight.copy_(reader.get(prefix + "weight", tuple(self.weight.shape), torch.float32))
            self.e_score_correction_bias.copy_(
                reader.get(prefix + "e_score_correction_bias", tuple(self.weight.shape[:1]), torch.float32)
            )


class MoE(nn.Module):
    """Routed experts (stacked: gate|up ``[E, 2Ie, H]``, down ``[E, H, Ie]``) plus the shared experts.

    Under tensor parallelism ``Ie`` is this rank's ``moe_intermediate_size / tp`` (see the module
    docstring) and ``forward`` returns the rank's partial output, all-reduced by the decoder layer.

    From a block-FP8 checkpoint (square tiles, as DeepSeek ships them) the routed experts stay float8 in
    memory with their tile scales (``experts_*_scale``; ``BlockScales``): they are most of the model's
    bytes, and the fused MoE dequantizes only the tiles it reads. The shared experts' projections stay
    float8 too (``SwiGLU`` with ``fp8_block``)."""

    def __init__(self, dims: DeepseekV3Dims, dtype: torch.dtype, tp: TensorParallel | None = None) -> None:
        super().__init__()
        tp = tp or TensorParallel()
        self.dims = dims
        e, h, i = dims.n_routed_experts, dims.hidden_size, dims.moe_intermediate_size
        self.local = local = tp.split(i, "moe_intermediate_size")
        self.gate = GroupLimitedRouter(dims)
        block = dims.fp8_block
        self.fp8_block = block if block is not None and block[0] == block[1] else None
        weight_dtype = torch.float8_e4m3fn if self.fp8_block else dtype
        self.experts_gate_up = param(e, 2 * local, h, dtype=weight_dtype)
        self.experts_down = param(e, h, local, dtype=weight_dtype)
        if self.fp8_block:
            b = self.fp8_block[0]
            # Where this rank's first feature sits in its tile: a checkpoint's shards need not start on tile
            # boundaries; experts quantized at load are tiled from the rank's own first feature.
            self.scale_offset = 0 if dims.quantize_at_load else tp.rank * local % b
            features, hidden = -(-(self.scale_offset + local) // b), -(-h // b)
            self.experts_gate_up_scale = param(e, 2, features, hidden, dtype=torch.float32)
            self.experts_down_scale = param(e, hidden, features, dtype=torch.float32)
        self.shared_experts = (
            SwiGLU(
                h,
                i * dims.n_shared_experts,
                dtype,
                tp=tp,
                what="moe_intermediate_size * n_shared_experts",
                fp8_block=dims.fp8_block,
                fp8_checkpoint=dims.fp8 is not None,
                fp8_activations=dims.fp8_activations,
            )
            if dims.n_shared_experts
            else None
        )

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, real_rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The block's (partial) output for the normed ``x``; with ``residual`` (the caller's own tensor,
        which may be overwritten) plus ``residual``, added in the shared experts' down projection.
        ``real_rows``: a prefill graph's padding starts there, and its rows take row 0's experts (their
        outputs are discarded; they read no expert the real rows do not)."""
        weights, ids = self.gate(x, real_rows)
        shared = self.shared_experts(x, residual) if self.shared_experts is not None else residual
        # Triton on CUDA (no host sync, graph-safe; the shared output added in the launch that sums the
        # choices): a decode step's few tokens one (token, choice) pair at a time, more through the grouped
        # GEMMs; the reference loop elsewhere.
        return ops.fused_moe(
            x, weights, ids, self.experts_gate_up, self.experts_down, self._scales(), add=shared
        )

    def _scales(self) -> BlockScales | None:
        if not self.fp8_block:
            return None
        return BlockScales(
            self.experts_gate_up_scale,
            self.experts_down_scale,
            self.fp8_block,
            self.scale_offset,
            self.dims.fp8_activations,
        )

    def load(self, reader: WeightReader, prefix: str) -> None:
        dims, dtype = self.dims, self.experts_down.dtype
        h, i, local = dims.hidden_size, dims.moe_intermediate_size, self.local
        rows, columns = split(0), split(1)
        self.gate.load(reader, prefix + "gate.")
        with torch.no_grad():
            for e in range(dims.n_routed_experts):
                p = f"{prefix}experts.{e}."
                if self.fp8_block:
                    self._load_fp8(reader, p, e)
                    continue
                gate_up = self.experts_gate_up[e]
                gate_up[:local].copy_(reader.get(p + "gate_proj.weight", (i, h), dtype, rows))
                gate_up[local:].copy_(reader.get(p + "up_proj.weight", (i, h), dtype, rows))
                self.experts_down[e].copy_(reader.get(p + "down_proj.weight", (h, i), dtype, columns))
        if self.shared_experts is not None:
            self.shared_experts.load(reader, prefix + "shared_experts.")

    def _load_fp8(self, reader: WeightReader, p: str, e: int) -> None:
        """Expert ``e``'s float8 weights and their tile scales (this rank's features only): as stored, or
        quantized here where the checkpoint holds them plain (``model.quantization=fp8``, or an expert an
        FP8 checkpoint left unquantized)."""
        h, i, local = self.dims.hidden_size, self.dims.moe_intermediate_size, self.local

        def blocks(name: str, shape: tuple[int, int], shard: Shard) -> tuple[torch.Tensor, torch.Tensor]:
            if not self.dims.quantize_at_load and name + "_scale_inv" in reader:
                return reader.get_blocks(name, shape, shard)
            # Plain weights (model.quantization=fp8, or an expert an FP8 checkpoint left unquantized):
            # quantized here on the tile grid the scales are laid out on (from ``scale_offset`` into the
            # first tile), zeros standing in for the features before the shard.
            plain = reader.get(name, shape, torch.float32, shard)
            return quantize_from(plain, self.fp8_block, self.scale_offset, shard.dim % 2)

        for half, name in enumerate(("gate_proj", "up_proj")):
            q, tiles = blocks(f"{p}{name}.weight", (i, h), split(0))
            self.experts_gate_up[e, half * local : (half + 1) * local].copy_(q)
            self._copy_tiles(self.experts_gate_up_scale[e, half], tiles, f"{p}{name}.weight_scale_inv")
        q, tiles = blocks(f"{p}down_proj.weight", (h, i), split(1))
        self.experts_down[e].copy_(q)
        self._copy_tiles(self.experts_down_scale[e], tiles, f"{p}down_proj.weight_scale_inv")

    @staticmethod
    def _copy_tiles(target: torch.Tensor, tiles: torch.Tensor, name: str) -> None:
        if tuple(tiles.shape) != tuple(target.shape):
            raise CheckpointError(
                f"tensor '{name}': this rank's tiles are {tuple(tiles.shape)}, expected {tuple(target.shape)}"
            )
        target.copy_(tiles)
