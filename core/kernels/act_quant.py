"""Per-token-group FP8 activations on the GPU: the pass that quantizes x before a W8A8 GEMM (block-FP8
projections, ``block_fp8_w8a8``; float8 experts, ``fused_moe``) and the float8 dot those GEMMs share.

A row's group of columns (the columns one weight tile spans) is divided by its largest magnitude over 448
and rounded to e4m3, as ``layers.block_fp8.quantize_activations_ref`` does, bit for bit (both divide
correctly rounded).
"""

from __future__ import annotations

import torch

from pegainfer.kernels._triton import HAS_TRITON, interpreting, tl, triton
from pegainfer.layers.block_fp8 import ACT_AMAX_FLOOR, FP8_MAX

if HAS_TRITON:
    _FLOOR = tl.constexpr(ACT_AMAX_FLOOR)
    _FP8_MAX = tl.constexpr(FP8_MAX)


@triton.jit
def to_e4m3(x, INTERP: tl.constexpr):
    """fp32 ``x`` (within ±448) as float8_e4m3fn, rounded to nearest even. With ``INTERP`` (Triton's
    interpreter, whose cast rounds values just under a power of two down a binade) the value is first
    rounded on its bits, so the cast only meets values it holds exactly."""
    if INTERP:
        bits = x.to(tl.uint32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
        # Below 2^-6 e4m3 is subnormal: multiples of 2^-9 (1.5 * 2^23 rounds an fp32 to an integer).
        sub = (x * 512.0 + 12582912.0) - 12582912.0
        sub = tl.where(sub == 0.0, x * 0.0, sub / 512.0)  # keeps -0's sign
        x = tl.where(tl.abs(x) < 0.015625, sub, normal)
    return x.to(tl.float8e4nv)


@triton.jit
def quantize_group(x, INTERP: tl.constexpr):
    """``x`` fp32 ``[rows, group]``: its float8 values and each row's scale (largest magnitude / 448)."""
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), 1), _FLOOR), _FP8_MAX)
    q = tl.clamp(tl.math.div_rn(x, scale[:, None]), -_FP8_MAX, _FP8_MAX)
    return to_e4m3(q, INTERP), scale


@triton.jit
def _quantize_kernel(
    x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, stride_sm, offset,
    GROUP: tl.constexpr, ROWS: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    g = tl.program_id(1)
    cols = g * GROUP - offset + tl.arange(0, GROUP)
    ok = (rows[:, None] < M) & (cols[None, :] >= 0) & (cols[None, :] < K)
    rows64 = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + rows64 * stride_xm + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    q, scale = quantize_group(x, INTERP)
    tl.store(q_ptr + rows64 * stride_qm + cols[None, :], q, mask=ok)
    tl.store(s_ptr + rows.to(tl.int64) * stride_sm + g, scale, mask=rows < M)


def quantize_activations(x: torch.Tensor, group: int, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``layers.block_fp8.quantize_activations_ref`` of ``x`` ``[M, K]`` on the GPU: ``(float8 [M, K],
    float32 scales [M, groups])``, group ``g`` holding columns ``[g·group - offset, (g+1)·group - offset)``."""
    m, k = x.shape
    groups = -(-(k + offset) // group)
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, groups, dtype=torch.float32, device=x.device)
    if m:
        rows = 8
        _quantize_kernel[(triton.cdiv(m, rows), groups)](
            x, q, s, m, k, x.stride(0), q.stride(0), s.stride(0), offset,
            GROUP=group, ROWS=rows, INTERP=interpreting(), num_warps=4,
        )  # fmt: skip
    return q, s


@triton.jit
def dot_fp8(a, b, INTERP: tl.constexpr):
    """``a @ b`` of two float8 blocks on the FP8 tensor cores, fp32 result; in the interpreter through
    fp32 (the products of two e4m3 values are exact there)."""
    if INTERP:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


_FP8_MMA: dict[int, bool] = {}


def check_fp8_mma(device: torch.device) -> None:
    """Raise a clear error where ``device`` has no FP8 tensor cores (CUDA compute capability below 8.9):
    a W8A8 GEMM would fail to compile there. CPU tensors (Triton's interpreter) pass."""
    if device.type != "cuda":
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _FP8_MMA:
        _FP8_MMA[index] = torch.cuda.get_device_capability(index) >= (8, 9)
    if not _FP8_MMA[index]:
        raise RuntimeError(
            f"W8A8 needs FP8 tensor cores (compute capability 8.9+), which {torch.cuda.get_device_name(index)} "
            "lacks: set model.fp8_activations=false"
        )
