"""Triton import shim and launch helpers shared by the kernels of this package.

Triton is a Linux-only dependency; elsewhere the kernels stay defined (as plain functions) and every
wrapper takes its torch reference, so importing ``pegainfer.kernels`` never fails.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - non-Linux hosts
    HAS_TRITON = False

    class _NoTriton:
        @staticmethod
        def jit(fn=None, **_kwargs):
            return fn if fn is not None else (lambda f: f)

        @staticmethod
        def next_power_of_2(n: int) -> int:
            return 1 << max(0, int(n) - 1).bit_length()

        @staticmethod
        def cdiv(a: int, b: int) -> int:
            return -(-a // b)

    triton = _NoTriton()
    tl = None

__all__ = [
    "HAS_TRITON",
    "triton",
    "tl",
    "use_kernel",
    "next_pow2",
    "warps_for",
    "as_rows",
    "dot_precision",
    "interp_bf16",
    "cast_to",
    "num_sms",
    "shared_memory_per_sm",
    "mma",
    "pdl_launch",
    "pdl_start",
    "pdl_start_ordered",
]


def use_kernel(t: torch.Tensor) -> bool:
    """The dispatch rule of every wrapper: the Triton kernel for CUDA tensors, the torch reference otherwise."""
    return HAS_TRITON and t.is_cuda


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def warps_for(n: int) -> int:
    """Warps for a program that handles ``n`` elements of a row (a launch heuristic of the row kernels)."""
    return 1 if n <= 256 else 2 if n <= 1024 else 4 if n <= 4096 else 8 if n <= 16384 else 16


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[rows, N]`` with a contiguous last dim (a view whenever the layout allows)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 2:
        return x
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:
        return x.reshape(-1, x.shape[-1])


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs multiply in full precision (tf32 would cost ~3e-4 relative error); 16-bit ignore it."""
    return "tf32x3" if dtype == torch.float32 else "tf32"


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def interp_bf16(dtype: torch.dtype) -> bool:
    """True when bf16 data meets the interpreter, whose bf16 support is partial: it multiplies bf16
    blocks as their raw uint16 bits and truncates fp32 -> bf16 casts. Kernels take this as a constexpr
    and route dots through :func:`mma` and narrowing casts through :func:`cast_to`, so the interpreter
    computes what the GPU computes (compiled kernels never take that branch)."""
    return dtype == torch.bfloat16 and interpreting()


@triton.jit
def mma(a, b, FIX: tl.constexpr, PREC: tl.constexpr):
    """``tl.dot(a, b)`` with an fp32 result. With ``FIX`` the operands are upcast first: exact for bf16
    values, and the products accumulate in fp32 as on the tensor cores."""
    if FIX:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PREC)


@triton.jit
def cast_to(x, dtype: tl.constexpr, FIX: tl.constexpr):
    """``x.to(dtype)``, rounding to nearest even; with ``FIX`` (fp32 -> bf16 in the interpreter) the
    rounding is done on the bits."""
    if FIX:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


_SM_COUNT: dict[int, int] = {}


def num_sms(device: torch.device) -> int:
    """Multiprocessor count of ``device`` (cached); 132 off CUDA so the heuristics stay deterministic."""
    if device.type != "cuda":
        return 132
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


_SMEM: dict[int, int] = {}


def shared_memory_per_sm(device: torch.device) -> int:
    """Shared memory of one multiprocessor of ``device`` in bytes (cached); the H100/H200's 228 KiB off
    CUDA or where torch does not report it."""
    if device.type != "cuda":
        return 228 * 1024
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMEM:
        props = torch.cuda.get_device_properties(index)
        _SMEM[index] = getattr(props, "shared_memory_per_multiprocessor", 0) or 228 * 1024
    return _SMEM[index]


_PDL: dict[int, bool] = {}


def _use_pdl(t: torch.Tensor) -> bool:
    if not (HAS_TRITON and t.is_cuda) or os.environ.get("PEGAINFER_PDL", "1") == "0":
        return False
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    if index not in _PDL:
        _PDL[index] = torch.cuda.get_device_capability(index)[0] >= 9 and hasattr(tl.extra.cuda, "gdc_wait")
    return _PDL[index]


def pdl_launch(t: torch.Tensor, early: bool = True) -> dict[str, bool]:
    """Launch arguments for programmatic dependent launch (PDL), for a kernel whose data is ``t``: the
    kernel's ``PDL`` constexpr and Triton's ``launch_pdl`` option, always equal. On with CUDA GPUs of
    compute capability 9+ (Hopper on), unless ``PEGAINFER_PDL=0`` or the caller's rule says not ``early``.
    A kernel launched so may be scheduled while the previous kernel of the stream is still running; it
    waits for it in :func:`pdl_start` before touching activations. Across the ~400 small kernels of a
    decode step this hides each launch's gap (see docs/benchmarks.md)."""
    on = early and _use_pdl(t)
    return {"PDL": on, "launch_pdl": on}


#: ``PEGAINFER_PDL_RELEASE_FIRST=1``: :func:`pdl_start` lets the next kernel be scheduled before it waits,
#: so a chain of short kernels can all be resident while the first still runs (an experiment; off by default).
PDL_RELEASE_FIRST = (tl.constexpr if HAS_TRITON else bool)(
    os.environ.get("PEGAINFER_PDL_RELEASE_FIRST") == "1"
)


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """With ``PDL``: wait until the previous kernel of the stream has finished and its writes are visible
    (nothing a kernel reads or writes may be touched before this, constant weights excepted), then let
    the next kernel be scheduled. Every kernel launched with ``launch_pdl`` calls this (or
    :func:`pdl_start_ordered`). Letting the next kernel in at once measured better than after the main loop
    (8.19 vs 8.27 ms a batch-1 step). With ``PDL_RELEASE_FIRST`` the next kernel is let in before the wait:
    its own wait still returns only after this kernel, which finishes only after its predecessor."""
    if PDL:
        if PDL_RELEASE_FIRST:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        else:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_start_ordered(PDL: tl.constexpr):
    """:func:`pdl_start` that always waits before it lets the next kernel in, for a kernel whose successor
    reads this kernel's predecessor's output before its own wait."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
