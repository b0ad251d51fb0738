"""Device dispatch: Triton kernels on CUDA, the torch reference of ``pegainfer.layers`` elsewhere.

Dependencies point one way: ``layers`` (the torch references, the oracle) <- ``kernels`` (Triton, each
checked against its reference) <- ``ops`` (this module, which picks one per device) <- the models. The
kernels are imported on first CUDA use only, so CPU runs (and the Triton interpreter tests, which must set
their environment before Triton is imported) never load them early.
"""

from __future__ import annotations

import os

import torch

from pegainfer.layers.activation import silu_mul as silu_mul_ref
from pegainfer.layers.attention import (
    AttentionMetadata,
    paged_attention_reference,
    reference_scratch_bytes,
)
from pegainfer.layers.attention import write_kv as write_kv_ref
from pegainfer.layers.block_fp8 import BlockFP8Weight, block_fp8_linear_ref
from pegainfer.layers.moe import BlockScales, combine_routed, routed_experts
from pegainfer.layers.norm import rms_norm as rms_norm_ref
from pegainfer.layers.rotary import RotaryEmbedding
from pegainfer.memory.buffer_specs import TransientSpec
from pegainfer.parallel.distributed import TensorParallel


def triton_enabled() -> bool:
    """False where ``PEGAINFER_DISABLE_TRITON=1`` asks for the torch reference on CUDA too."""
    return os.environ.get("PEGAINFER_DISABLE_TRITON", "0") != "1"


def use_triton(t: torch.Tensor) -> bool:
    """Triton kernels for CUDA tensors unless ``PEGAINFER_DISABLE_TRITON=1`` asks for the torch reference."""
    return t.is_cuda and triton_enabled()


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The plain RMSNorm (``layers.norm.rms_norm``), written into ``out`` when given."""
    if use_triton(x):
        from pegainfer.kernels import norms

        return norms.rms_norm(x, weight, eps, out=out)
    y = rms_norm_ref(x, weight, eps)
    return y if out is None else out.copy_(y)


def add_rms_norm(
    delta: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual += delta`` then its RMSNorm; returns (normed, residual). On CUDA one kernel, in place."""
    if use_triton(delta):
        from pegainfer.kernels import norms

        return norms.fused_add_rms_norm(delta, residual, weight, eps)
    residual = residual + delta
    return rms_norm_ref(residual, weight, eps), residual


def argmax(logits: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``logits.argmax(-1)`` of ``[rows, V]`` logits (int64, into ``out`` when given): on CUDA two launches
    that spread a row over the GPU (``kernels.argmax``), where torch's one reduction is slow on a vocabulary."""
    if use_triton(logits) and logits.dim() == 2 and logits.stride(-1) == 1:
        from pegainfer.kernels import argmax as argmax_kernels

        return argmax_kernels.argmax(logits, out=out)
    return torch.argmax(logits, dim=-1, out=out)


def linear(
    x: torch.Tensor, w: torch.Tensor | BlockFP8Weight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(x.to(w.dtype), w, bias)`` (a 16-bit ``x`` may meet an fp32 ``w``, as a router's does); on
    CUDA, decode-sized row counts stream the weight through the skinny kernel, the upcast inside it. A
    block-FP8 ``w`` gives ``x``'s dtype: on CUDA its kernel at every row count, elsewhere the dequantized
    reference."""
    if isinstance(w, BlockFP8Weight):
        return _block_fp8_linear(x, w, bias)
    if use_triton(x):
        from pegainfer.kernels import skinny_gemm

        return skinny_gemm.skinny_linear(x, w, bias)
    return torch.nn.functional.linear(x.to(w.dtype), w, bias)


def linear_add(x: torch.Tensor, w: torch.Tensor | BlockFP8Weight, residual: torch.Tensor) -> torch.Tensor:
    """``residual + x @ w.T``. Where the skinny kernel runs (decode rows on CUDA) the add happens in the
    GEMM's epilogue, written into ``residual`` in place, so the caller must own ``residual``; elsewhere a
    new tensor. (``residual_linear`` is the form for a row-parallel projection that all-reduces.)"""
    if isinstance(w, BlockFP8Weight):
        return _block_fp8_linear(x, w, residual=residual)
    if use_triton(x):
        from pegainfer.kernels import skinny_gemm

        if skinny_gemm.takes_kernel(x) and w.dtype == x.dtype:
            return skinny_gemm.skinny_linear_triton(x, w, residual=residual)
    return residual + linear(x, w)


def linear_silu(x: torch.Tensor, w: torch.Tensor | BlockFP8Weight) -> torch.Tensor:
    """``silu(gate) * up`` of ``x @ w.T`` for an interleaved gate|up ``w`` (``layers.activation.
    interleave_gate_up``): on CUDA decode rows, the activation in the skinny GEMM's epilogue (a block-FP8
    ``w``: at every row count)."""
    if isinstance(w, BlockFP8Weight):
        return _block_fp8_linear(x, w, silu=True)
    if use_triton(x):
        from pegainfer.kernels import skinny_gemm

        if skinny_gemm.takes_kernel(x):
            return skinny_gemm.skinny_linear_triton(x, w, silu=True)
    return silu_mul(linear(x, w))


def _block_fp8_linear(
    x: torch.Tensor,
    w: BlockFP8Weight,
    bias: torch.Tensor | None = None,
    *,
    silu: bool = False,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    if use_triton(x):
        if w.fp8_activations:
            from pegainfer.kernels import block_fp8_w8a8

            return block_fp8_w8a8.block_fp8_w8a8_triton(x, w, bias, silu=silu, residual=residual)
        from pegainfer.kernels import block_fp8_gemm

        return block_fp8_gemm.block_fp8_linear_triton(x, w, bias, silu=silu, residual=residual)
    return block_fp8_linear_ref(x, w, bias, silu=silu, residual=residual, fp8_activations=w.fp8_activations)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a packed ``[..., 2I]`` gate|up projection whose columns alternate gate, up."""
    if use_triton(gate_up):
        from pegainfer.kernels import activations

        return activations.silu_mul(gate_up)
    return silu_mul_ref(gate_up)


def fused_moe(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    scales: BlockScales | None = None,
    add: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """The routed experts' output ``[T, H]``, ``Σ_k weights[t, k] · Expert_{ids[t, k]}(x[t])`` over stacked
    experts (gate|up ``[E, 2I, H]``, down ``[E, H, I]``; block-FP8 with ``scales``), plus ``add`` (e.g. the
    shared experts' output) where given, added into ``residual`` in place (and returned) where given: on
    CUDA Triton kernels with no host sync (graph-safe; the add and the residual ride the launch that sums the choices), one program per
    (token, choice) for a decode step's few tokens, grouped GEMMs over the sorted choices otherwise;
    elsewhere the reference loop and ``combine_routed``."""
    if use_triton(x):
        from pegainfer.kernels import moe_pairs
        from pegainfer.kernels.fused_moe import fused_moe_triton

        # A decode step's few tokens: one program per (token, choice), no sort; else the grouped GEMMs.
        run = moe_pairs.fused_moe_pairs if moe_pairs.takes_pairs(x, scales) else fused_moe_triton
        return run(x, weights, ids, gate_up, down, scales=scales, add=add, residual=residual)
    out = routed_experts(x, weights, ids, gate_up, down, scales=scales)
    return combine_routed(out, add, residual)


def norm_linear(
    residual: torch.Tensor,
    delta: torch.Tensor | None,
    w: torch.Tensor,
    eps: float,
    bias: torch.Tensor | None = None,
    *,
    silu: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The projection by ``w`` of ``rms_norm(residual + delta)`` (``delta`` None: nothing left to add),
    ``w`` carrying the norm's weight (``layers.norm.fold_rms_norm_weight``); with ``silu`` ``w`` is an
    interleaved gate|up and the result its activation. Returns (output, residual + delta).

    Where the skinny kernel runs (decode rows on CUDA, after :func:`residual_linear` added in its GEMM)
    the norm and the activation happen inside this GEMM; elsewhere a fused add + norm, the GEMM and
    silu_mul, as many launches as with the norm's weight kept."""
    if use_triton(residual):
        from pegainfer.kernels import skinny_gemm

        if delta is None and skinny_gemm.takes_kernel(residual):
            return skinny_gemm.skinny_linear_triton(residual, w, bias, norm_eps=eps, silu=silu), residual
    if delta is None:
        h = rms_norm(residual, None, eps)
    else:
        h, residual = add_rms_norm(delta, residual, None, eps)
    out = linear(h, w, bias)
    return (silu_mul(out) if silu else out), residual


def residual_linear(
    x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, tp: TensorParallel | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x @ w.T`` for the residual stream: added inside the GEMM where the skinny kernel runs (returns
    (the new residual, None)), else returned as the delta that the next :func:`norm_linear` adds in its
    fused norm (returns (residual, delta)).

    With ``tp`` the projection is row-parallel (``w`` holds this rank's input columns) and its partial
    sums are all-reduced; inside the GEMM rank 0 alone adds the residual before the reduce, so the other
    ranks' residual is the reduced tensor returned (not the one passed in)."""
    if use_triton(x):
        from pegainfer.kernels import skinny_gemm

        if skinny_gemm.takes_kernel(x):
            if tp is None or tp.group is None:
                return skinny_gemm.skinny_linear_triton(x, w, residual=residual), None
            partial = skinny_gemm.skinny_linear_triton(x, w, residual=residual if tp.rank == 0 else None)
            return tp.all_reduce(partial), None
    delta = linear(x, w)
    return residual, (delta if tp is None else tp.all_reduce(delta))


def qk_norm_rope_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    rotary: RotaryEmbedding,
    positions: torch.Tensor,
    eps: float,
    cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Per-head RMSNorm of q ``[T, H, D]`` and k ``[T, KVH, D]``, rotary at ``positions``, k and v written
    into the pages at ``meta.slot_mapping``, then ``paged_attention``: the attention output ``[T, H, D]``.
    On CUDA a batch of decode rows only takes one kernel (the decode attention normalises and rotates its
    q and the new k and writes the cache itself), any other batch the rope kernel then attention; ``k``
    is scratch afterwards."""
    slot_mapping = meta.slot_mapping
    if use_triton(q):
        from pegainfer.kernels import paged_decode_attention as decode
        from pegainfer.kernels import rope_kv

        if meta.num_decodes and not meta.prefills:
            rope = decode.DecodeRope(k, v, q_weight, k_weight, rotary, positions, slot_mapping, eps)
            return decode.paged_decode_attention(
                q, cache, meta.decode_block_tables, meta.decode_seq_lens, scale,
                max_seq_len=meta.max_decode_seq_len, rope=rope,
            )  # fmt: skip
        q, _ = rope_kv.qk_norm_rope(
            q, k, q_weight, k_weight, rotary, positions, eps, kv_cache=cache, v=v, slot_mapping=slot_mapping
        )
    else:
        q, k = rotary(positions, rms_norm_ref(q, q_weight, eps), rms_norm_ref(k, k_weight, eps))
        write_kv_ref(cache, k, v, slot_mapping)
    return paged_attention(q, cache, meta, scale)


def write_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v ``[T, KVH, D]`` into the pages at ``slot_mapping``, negative slots skipped: one kernel on CUDA,
    with no host sync (graph-safe), the reference elsewhere (which skips them on the CPU only)."""
    if use_triton(k):
        from pegainfer.kernels import rope_kv

        rope_kv.write_kv(cache, k, v, slot_mapping)
        return
    write_kv_ref(cache, k, v, slot_mapping)


def paged_attention(
    q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Causal GQA attention of q ``[T, heads, D]`` over the paged cache; returns ``[T, heads, D]``.

    Query head h reads KV head ``h // (heads / kv_heads)``. Triton kernels on CUDA, the torch reference
    (``paged_attention_reference``) elsewhere.
    """
    if use_triton(q):
        return _paged_attention_kernels(q, cache, meta, scale)
    return paged_attention_reference(q, cache, meta, scale)


def _paged_attention_kernels(
    q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """The Triton path: one varlen launch for the prefill segments, one split-K launch for decode rows."""
    from pegainfer.kernels.paged_decode_attention import paged_decode_attention
    from pegainfer.kernels.paged_prefill_attention import paged_prefill_attention, prefill_tensors

    out = torch.empty_like(q)
    if meta.prefills:
        packed = meta.derived.get("prefill_tensors")
        if packed is None:  # once per forward, not per layer
            packed = meta.derived["prefill_tensors"] = prefill_tensors(meta.prefills, q.device)
        rows = slice(0, meta.num_prefill_tokens)
        paged_prefill_attention(q[rows], cache, packed, scale, out=out[rows])
    if meta.num_decodes:
        rows = slice(meta.num_prefill_tokens, meta.num_prefill_tokens + meta.num_decodes)
        paged_decode_attention(
            q[rows],
            cache,
            meta.decode_block_tables,
            meta.decode_seq_lens,
            scale,
            out=out[rows],
            max_seq_len=meta.max_decode_seq_len,
        )
    return out


def attention_scratch(
    num_heads: int, kv_heads: int, head_dim: int, max_model_len: int, dtype: torch.dtype, device: torch.device
) -> TransientSpec:
    """The attention backend's scratch on ``device``, for the memory plan."""
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    if device.type == "cuda":
        # The split-K partials: decode's, sized for a generous row count (the plan reserves, it does not
        # allocate), and those of a short prefill chunk whose keys are split; a step has both.
        from pegainfer.kernels.paged_decode_attention import decode_num_splits, decode_workspace_bytes
        from pegainfer.kernels.paged_prefill_attention import prefill_workspace_bytes

        rows = 1024
        splits = decode_num_splits(rows, kv_heads, max_model_len)
        decode = decode_workspace_bytes(rows, num_heads, head_dim, splits)
        return TransientSpec(
            "attention_scratch", bytes_fixed=decode + prefill_workspace_bytes(head_dim, device)
        )
    return TransientSpec(
        "attention_scratch",
        bytes_fixed=reference_scratch_bytes(num_heads, kv_heads, head_dim, max_model_len, dtype_bytes),
    )
