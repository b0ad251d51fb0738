"""A projection's weight kept in block FP8, and the torch references of its GEMM (W8A16, W8A8).

DeepSeek's FP8 checkpoints store ``X.weight`` as float8_e4m3fn with one float32 scale per 128 × 128
tile. :class:`BlockFP8Weight` keeps the float8 values and gives every *row* its tiles' scales along the
columns (``scale`` ``[N, tiles]``): a row order the tiles do not follow (gate and up rows interleaved,
two projections stacked, a tensor-parallel shard that starts inside a tile) stays expressible, for 4
bytes per row per 128 columns (3% of the float8 bytes). Only the columns may start inside a tile: column
``c`` of the weight takes its row's scale ``(c + offset) // block``. Once loaded, the weight notes which
rows share their scales (``settle_scales``), so the GEMMs load one scale a tile of rows, not one a row.

The kernel (``pegainfer.kernels.block_fp8_gemm``) multiplies the float8 values (exact in bf16) and scales
each row's partial sum per tile; the reference dequantizes the whole weight first, exactly as the
checkpoint reader dequantizes at load (the fp32 product, then the model's dtype). With FP8 activations
(the checkpoints' ``activation_scheme: dynamic``) each row's group of columns that shares a weight tile
is quantized to float8 as well, with its own scale, and both operands meet on the FP8 tensor cores
(``pegainfer.kernels.block_fp8_w8a8``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pegainfer.layers.activation import silu_mul

#: The largest finite float8_e4m3fn: a quantized block's largest magnitude maps to it.
FP8_MAX = 448.0
#: A floor under an activation group's largest magnitude, so an all-zero group gets a finite scale.
ACT_AMAX_FLOOR = 1e-10


class BlockFP8Weight(nn.Module):
    """``weight`` float8_e4m3fn ``[N, K]`` and ``scale`` float32 ``[N, ceil((offset + K) / block)]``,
    uninitialised (filled by ``load_rows``) on the current default device. ``fp8_activations``: its GEMM
    quantizes the activations per row and tile too (W8A8, ``kernels.block_fp8_w8a8``), else they stay
    16-bit (W8A16, ``kernels.block_fp8_gemm``)."""

    def __init__(self, n: int, k: int, block: int, offset: int = 0, fp8_activations: bool = False) -> None:
        super().__init__()
        if not 0 <= offset < block:
            raise ValueError(f"a column offset must lie inside the first tile: 0 <= {offset} < {block}")
        self.block = block
        self.offset = offset
        self.fp8_activations = fp8_activations
        tiles = -(-(offset + k) // block)
        self.weight = nn.Parameter(torch.empty(n, k, dtype=torch.float8_e4m3fn), requires_grad=False)
        self.scale = nn.Parameter(torch.empty(n, tiles, dtype=torch.float32), requires_grad=False)
        #: How the loaded rows share their scales (:meth:`settle_scales`): ``(group, period)``, inside
        #: every aligned group of ``group`` rows the rows ``period`` apart share one; None: not examined.
        #: Scales change only through ``load_rows`` or a state dict, both of which reset it.
        self.scale_groups: tuple[int, int] | None = None

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def load_rows(self, rows: slice, weight: torch.Tensor, scale: torch.Tensor) -> None:
        """Rows ``rows`` from float8 ``weight`` and their per-row tile scales ``scale`` (``[rows, tiles]``
        on this weight's column grid)."""
        target_w, target_s = self.weight[rows], self.scale[rows]
        if weight.shape != target_w.shape or scale.shape != target_s.shape or weight.dtype != target_w.dtype:
            raise ValueError(
                f"rows {rows.start}:{rows.stop} take a {tuple(target_w.shape)} float8 weight and "
                f"{tuple(target_s.shape)} scales, got {tuple(weight.shape)} {weight.dtype} and "
                f"{tuple(scale.shape)}"
            )
        with torch.no_grad():
            target_w.copy_(weight)
            target_s.copy_(scale)
        self.scale_groups = None  # until the loader settles the whole weight again

    def _load_from_state_dict(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        super()._load_from_state_dict(*args, **kwargs)
        self.scale_groups = None  # scales written past load_rows: examined anew by settle_scales

    def settle_scales(self) -> None:
        """Find the groups of rows that share their scales, once the weight is loaded: a checkpoint's
        128 x 128 tiles give every aligned group of 128 rows one scale row (period 1), or, with gate and
        up rows interleaved, the even and the odd rows of a group one each (period 2); a shard that starts
        inside a tile shares in smaller groups or not at all. The GEMMs then load one or two scales a
        tile of rows instead of one a row (:meth:`scale_period`)."""
        self.scale_groups = None
        scale = self.scale
        rows = torch.arange(scale.shape[0], device=scale.device)
        for period in (1, 2):
            for group in (128, 64, 32, 16):
                if torch.equal(scale, scale[rows - rows % group + rows % period]):
                    self.scale_groups = (group, period)
                    return

    def scale_period(self, block_n: int) -> int:
        """How a GEMM tiling the rows by ``block_n`` may load the scales (``kernels.skinny_gemm.
        scale_rows``): 1 or 2 where every tile lies inside one group of rows sharing them, else 0
        (each row its own)."""
        if self.scale_groups is None:
            return 0
        group, period = self.scale_groups
        return period if group % block_n == 0 and block_n % period == 0 else 0

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight in ``dtype``: each element times its scale in fp32, then rounded once."""
        k = self.weight.shape[1]
        scale = self.scale.repeat_interleave(self.block, dim=1).narrow(1, self.offset, k)
        return (self.weight.float() * scale).to(dtype)


def settle_scales(model: nn.Module) -> None:
    """:meth:`BlockFP8Weight.settle_scales` of every block-FP8 weight in ``model`` (after loading)."""
    for module in model.modules():
        if isinstance(module, BlockFP8Weight):
            module.settle_scales()


def widened_bytes(model: nn.Module, dtype: torch.dtype) -> int:
    """The scratch a prefill step of ``model`` widens its block-FP8 projections into on CUDA
    (``kernels.block_fp8_gemm.widened_scratch``): its largest one in ``dtype``; 0 without any."""
    sizes = [m.weight.numel() for m in model.modules() if isinstance(m, BlockFP8Weight)]
    return max(sizes, default=0) * torch.empty((), dtype=dtype).element_size()


def row_scales(tiles: torch.Tensor, block_rows: int, first_row: int, rows: int) -> torch.Tensor:
    """Per-row scales ``[rows, tiles]`` from tile scales ``tiles`` whose first tile row starts at weight
    row ``first_row - first_row % block_rows`` (tiles of ``block_rows`` rows)."""
    return tiles.repeat_interleave(block_rows, dim=0).narrow(0, first_row % block_rows, rows).contiguous()


def block_fp8_linear_ref(
    x: torch.Tensor,
    w: BlockFP8Weight,
    bias: torch.Tensor | None = None,
    *,
    silu: bool = False,
    residual: torch.Tensor | None = None,
    fp8_activations: bool = False,
) -> torch.Tensor:
    """``x @ w.T (+ bias)`` in ``x``'s dtype over the dequantized weight; ``silu``: the rows alternate
    gate, up and the result is ``silu(gate) * up``; ``residual``: returns ``residual + y``, a new tensor.
    ``fp8_activations`` (W8A8): ``x`` quantized per row and weight tile first
    (:func:`quantize_activations_ref`), the product of the two dequantized operands in fp32."""
    if fp8_activations:
        q, scale = quantize_activations_ref(x, w.block, w.offset)
        y32 = F.linear(dequantize_activations(q, scale, w.block, w.offset), w.dequantize(torch.float32))
        y = (y32 if bias is None else y32 + bias.float()).to(x.dtype)
    else:
        y = F.linear(x, w.dequantize(x.dtype), bias)
    if silu:
        return silu_mul(y)
    return y if residual is None else residual + y


def quantize_activations_ref(
    x: torch.Tensor, group: int, offset: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token-group FP8 activations: ``(q, scale)`` with ``q`` float8_e4m3fn of ``x``'s shape and
    ``scale`` float32 ``[..., ceil((offset + K) / group)]``; group ``g`` holds columns ``[g·group - offset,
    (g+1)·group - offset)`` (a weight's tile grid: ``BlockFP8Weight.offset``), divided by its largest
    magnitude over 448 (floored at ``ACT_AMAX_FLOOR``) and rounded to nearest even. ``q · scale``
    approximates ``x`` to e4m3's 3 mantissa bits."""
    k = x.shape[-1]
    groups = -(-(offset + k) // group)
    padded = F.pad(x.float(), (offset, groups * group - k - offset)).unflatten(-1, (groups, group))
    amax = padded.abs().amax(-1).clamp(min=ACT_AMAX_FLOOR)
    # A true division (by a tensor): CUDA's tensor-by-Python-scalar division multiplies by the reciprocal,
    # one ulp off the kernels' correctly rounded quotient.
    scale = amax / torch.full_like(amax, FP8_MAX)
    q = (padded / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.flatten(-2)[..., offset : offset + k].contiguous(), scale


def dequantize_activations(q: torch.Tensor, scale: torch.Tensor, group: int, offset: int = 0) -> torch.Tensor:
    """float32 ``q · scale`` of :func:`quantize_activations_ref`'s output."""
    return q.float() * scale.repeat_interleave(group, dim=-1)[..., offset : offset + q.shape[-1]]
