"""Device dispatch for the small fused ops: Triton kernels on CUDA, the torch reference elsewhere.

The kernels are imported on first CUDA use only, so CPU runs (and the Triton interpreter tests, which
must set their environment before Triton is imported) never load them early.
"""

from __future__ import annotations

import torch

from pegainfer.layers.attention import use_triton, write_kv
from pegainfer.layers.norm import rms_norm as rms_norm_ref
from pegainfer.layers.rotary import RotaryEmbedding


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if use_triton(x):
        from pegainfer.kernels import norms

        return norms.rms_norm(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def add_rms_norm(
    delta: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual += delta`` then its RMSNorm; returns (normed, residual). On CUDA one kernel, in place."""
    if use_triton(delta):
        from pegainfer.kernels import norms

        return norms.fused_add_rms_norm(delta, residual, weight, eps)
    residual = residual + delta
    return rms_norm_ref(residual, weight, eps), residual


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``; on CUDA, decode-sized row counts stream the weight through the skinny kernel."""
    if use_triton(x):
        from pegainfer.kernels import skinny_gemm

        return skinny_gemm.skinny_linear(x, w, bias)
    return torch.nn.functional.linear(x, w, bias)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a packed ``[..., 2I]`` gate|up projection."""
    if use_triton(gate_up):
        from pegainfer.kernels import activations

        return activations.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def qk_norm_rope_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    rotary: RotaryEmbedding,
    positions: torch.Tensor,
    eps: float,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of q ``[T, H, D]`` and k ``[T, KVH, D]``, rotary at ``positions``, and k, v written
    into the pages at ``slot_mapping``; returns the rotated (q, k)."""
    if use_triton(q):
        from pegainfer.kernels import rope_kv

        return rope_kv.qk_norm_rope(
            q, k, q_weight, k_weight, rotary, positions, eps, kv_cache=cache, v=v, slot_mapping=slot_mapping
        )
    q, k = rotary(positions, rms_norm_ref(q, q_weight, eps), rms_norm_ref(k, k_weight, eps))
    write_kv(cache, k, v, slot_mapping)
    return q, k
