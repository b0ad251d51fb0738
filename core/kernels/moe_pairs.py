"""Routed experts of a decode step's few tokens, one (token, choice) pair at a time: no expert sort.

At batch 1 the chosen experts are distinct, so the sorted grouped GEMMs of ``pegainfer.kernels.fused_moe``
buy nothing there: they cost the sort's launch and 16-row tensor-core tiles with one live row as the wide
operand. Here, as in the skinny GEMM, the weight tile is the wide operand and the pair's input row the
narrow one:

- ``gate_up``: one program per (pair, tile of ``BLOCK_N`` features, split of the columns) sums
  ``x[t] · Wg_eᵀ`` and ``x[t] · Wu_eᵀ`` for expert ``e = ids[p]`` (stacked gate|up ``[E, 2I, H]``) over its
  share of the columns, in fp32. Small experts (Qwen3.5-35B-A3B's 512 features at hidden 2048) make too
  few programs to keep the memory system busy; splitting the columns doubles them.
- ``down``: one program per (pair, tile of ``BLOCK_N`` hidden features) adds the splits' sums as it loads
  them, ``act = silu(gate) · up`` rounded as the grouped path rounds it, and stores
  ``y[p] = w[p] · (act · Wd_eᵀ)``;
- the grouped path's last launch (:func:`pegainfer.kernels.fused_moe.combine_choices`) sums each token's
  choices in order and adds the shared experts' output and the residual.

A pair reads its expert whole, so two tokens choosing one expert read it twice: :func:`takes_pairs` keeps
this path to a few tokens, where it measured faster. Block-FP8 experts take it where every kernel tile sits
inside one quantization tile (its one scale multiplies the dot); else the grouped path, as W8A8 experts
(``BlockScales.fp8_activations``) do: quantizing the pair's row in this path's loops measured slow (see
``kernels.block_fp8_w8a8``), and the grouped path quantizes x and the activation in a pass each.
Graph-safe, no host sync. Measured on the H200 (``python bench/fused_moe_tiles.py --pairs [--fp8]``, 2026-12-04, 16 calls a
graph to fresh experts; grouped -> pairs): Qwen3.5-35B-A3B's experts at 1 token 27.4 -> 19.6 us (40.8% ->
57.0% of the read rate), 4 tokens 63.3 -> 56.2, 8 tokens 112.6 -> 96.5; DeepSeek-V3's 178.1 -> 169.5 at 1,
632.9 -> 618.0 at 4, 1146 -> 1156 at 8; Moonlight's 35.9 -> 32.3 at 1, 100.7 -> 97.7 at 4, 156.4 -> 158.7
at 8; DeepSeek-V3's float8 experts 120.5 -> 108.1 at 1, 225.1 -> 214.9 at 2, 365.4 -> 377.5 at 4.

On Hopper the three launches start early (PDL) where gate|up's programs are fewer than the
multiprocessors (:func:`launches_early`), and each waits for the one before: down reads its expert ids
before its wait, since they were written before gate|up, which lets down in only after its own wait.
Whole decode steps on an H100 (docs/benchmarks.md, twenty-sixth and twenty-ninth sessions), early launch
off -> on for all three: Qwen3.5-35B-A3B at 1 token (72 gate|up programs) 1.81 -> 1.78 ms (20 layers),
Moonlight (132 programs) 3.667 -> 3.685, DeepSeek-V3 with float8 experts (256 programs) 1.852 -> 1.959.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from pegainfer.kernels._triton import (
    cast_to,
    dot_precision,
    interp_bf16,
    mma,
    num_sms,
    pdl_launch,
    pdl_start,
    pdl_start_ordered,
    tl,
    triton,
)
from pegainfer.kernels.fused_moe import check_args, combine_choices
from pegainfer.layers.moe import BlockScales

#: Most tokens the pair path takes (the grouped path reads an expert once for all its tokens): bf16 and
#: float8 experts (the grouped path measured faster at 4 float8 tokens).
PAIR_TOKENS = 4
PAIR_TOKENS_FP8 = 2


@dataclass(frozen=True)
class PairTiles:
    """Tiles of the two launches: (features, columns per load, loads in flight) each, and how many
    programs share one gate|up tile's columns (their fp32 partial sums are added where down loads them).
    Each launch's default was within 2% of that launch's best in the sweep (27 tilings, 18 for float8)
    at each of the four expert shapes."""

    gate_up_n: int = 64
    gate_up_k: int = 128
    gate_up_stages: int = 3
    gate_up_split: int = 1
    down_n: int = 64
    down_k: int = 128
    down_stages: int = 3
    num_warps: int = 4


@triton.jit
def _scaled_dot(w, a, scale_ptr, QUANT: tl.constexpr, FIX: tl.constexpr, PREC: tl.constexpr):
    """``w @ aᵀ`` ``[BLOCK_N, 16]`` in fp32: a float8 ``w`` enters in ``a``'s dtype (exact in bf16) and the
    dot is scaled by its quantization tile's one scale."""
    if QUANT:
        w = cast_to(w.to(tl.float32), a.dtype, FIX)
        return mma(w, tl.trans(a), FIX, PREC) * tl.load(scale_ptr)
    else:
        return mma(w, tl.trans(a).to(w.dtype), FIX, PREC)


@triton.jit
def _columns_ok(k, offs_k, K, EVEN_K: tl.constexpr):
    """Which of the columns ``k + offs_k`` lie inside ``K`` (all of them where ``EVEN_K``)."""
    if EVEN_K:
        return offs_k >= 0
    else:
        return k + offs_k < K


@triton.jit
def _pair_gate_up_kernel(
    x_ptr,
    w_ptr,
    ids_ptr,
    part_ptr,
    scale_ptr,
    num_pairs,
    hidden,
    inter,
    stride_x,
    stride_we,
    stride_wn,
    stride_se,
    stride_shalf,
    stride_srow,
    stride_scol,
    scale_offset,
    QUANT: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
    EVEN_K: tl.constexpr,
    PREC: tl.constexpr,
    FIX: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (pair, tile, split): the fp32 sums of its share of the columns for the tile's gate and up
    features, into ``part[split, pair]`` (``[SPLIT, P, 2I]``: gate, then up)."""
    pdl_start_ordered(PDL)  # ids are the previous launch's output; down reads them before its wait
    pair = tl.program_id(0)
    split = tl.program_id(2)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    token = (pair // TOP_K).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # The pair's row is row 0 of a 16-row operand (the smallest tensor-core tile); the others load zeros.
    only_row = (tl.arange(0, 16) == 0)[:, None]
    n_ok = (offs_n < inter)[:, None]
    x_ptrs = x_ptr + token * stride_x + tl.arange(0, 16)[:, None] * 0 + offs_k[None, :]
    g_ptrs = w_ptr + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    u_ptrs = g_ptrs + inter * stride_wn
    scales = scale_ptr + expert * stride_se
    scales += (tl.program_id(1) * BLOCK_N + scale_offset) // BLOCK_ROWS * stride_srow
    per_split = tl.cdiv(tl.cdiv(hidden, BLOCK_K), SPLIT) * BLOCK_K
    acc_g = tl.zeros([BLOCK_N, 16], tl.float32)
    acc_u = tl.zeros([BLOCK_N, 16], tl.float32)
    for k in range(split * per_split, tl.minimum(hidden, (split + 1) * per_split), BLOCK_K):
        k_ok = _columns_ok(k, offs_k, hidden, EVEN_K)
        a = tl.load(x_ptrs + k, mask=only_row & k_ok[None, :], other=0.0)
        g = tl.load(g_ptrs + k, mask=n_ok & k_ok[None, :], other=0.0)
        u = tl.load(u_ptrs + k, mask=n_ok & k_ok[None, :], other=0.0)
        s = scales + k // BLOCK_COLS * stride_scol
        acc_g += _scaled_dot(g, a, s, QUANT, FIX, PREC)
        acc_u += _scaled_dot(u, a, s + stride_shalf, QUANT, FIX, PREC)
    # Columns 1..15 are zeros: the sum over them is column 0 exactly.
    out = part_ptr + (split * num_pairs + pair).to(tl.int64) * 2 * inter + offs_n
    tl.store(out, tl.sum(acc_g, 1), mask=offs_n < inter)
    tl.store(out + inter, tl.sum(acc_u, 1), mask=offs_n < inter)


@triton.jit
def _pair_act(
    part_ptr,
    pair,
    k,
    offs_k,
    k_ok,
    num_pairs,
    inter,
    SPLIT: tl.constexpr,
    DTYPE: tl.constexpr,
    FIX: tl.constexpr,
):
    """``silu(gate) * up`` of ``pair``'s features ``k + offs_k`` from the splits' partial sums, as row 0
    of a ``[16, BLOCK_K]`` operand in ``DTYPE`` (rounded where the grouped path rounds its ``act``)."""
    gate = tl.zeros_like(offs_k).to(tl.float32)
    up = tl.zeros_like(offs_k).to(tl.float32)
    for s in tl.static_range(SPLIT):
        at = part_ptr + (s * num_pairs + pair).to(tl.int64) * 2 * inter + k + offs_k
        gate += tl.load(at, mask=k_ok, other=0.0)
        up += tl.load(at + inter, mask=k_ok, other=0.0)
    act = cast_to(gate / (1.0 + tl.exp(-gate)) * up, DTYPE, FIX)
    return tl.where((tl.arange(0, 16) == 0)[:, None], act[None, :], 0.0).to(DTYPE)


@triton.jit
def _pair_down_kernel(
    part_ptr,
    w_ptr,
    ids_ptr,
    weights_ptr,
    y_ptr,
    scale_ptr,
    num_pairs,
    hidden,
    inter,
    stride_we,
    stride_wn,
    stride_se,
    stride_srow,
    stride_scol,
    scale_offset,
    QUANT: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    PREC: tl.constexpr,
    FIX: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (pair, tile): ``y[pair] = w[pair] · (act[pair] · Wd_eᵀ)`` for the tile's features."""
    pair = tl.program_id(0).to(tl.int64)
    # ids may be read before the wait: they are the output of the launch before gate|up, which let this
    # launch in only after its own wait (so that launch had finished and its writes were visible).
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    pdl_start(PDL)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = (offs_n < hidden)[:, None]
    w_ptrs = w_ptr + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    scales = scale_ptr + expert * stride_se + (tl.program_id(1) * BLOCK_N) // BLOCK_ROWS * stride_srow
    dtype: tl.constexpr = y_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_N, 16], tl.float32)
    for k in range(0, inter, BLOCK_K):
        k_ok = _columns_ok(k, offs_k, inter, EVEN_K)
        a = _pair_act(part_ptr, pair, k, offs_k, k_ok, num_pairs, inter, SPLIT, dtype, FIX)
        w = tl.load(w_ptrs + k, mask=n_ok & k_ok[None, :], other=0.0)
        acc += _scaled_dot(w, a, scales + (k + scale_offset) // BLOCK_COLS * stride_scol, QUANT, FIX, PREC)
    y = tl.sum(acc, 1) * tl.load(weights_ptr + pair).to(tl.float32)
    tl.store(y_ptr + pair * hidden + offs_n, cast_to(y, dtype, FIX), mask=offs_n < hidden)


def default_tiles(pairs: int, inter: int, sms: int) -> PairTiles:
    """The default tiles, with gate|up's columns split in two where that still fits one wave of programs
    over the ``sms`` multiprocessors (measured at 1 token: Qwen3.5-35B-A3B's 64 programs 21.0 -> 20.4 us
    split in two, 23.9 in four; Moonlight's 132 and DeepSeek-V3's 256 slower split)."""
    tiles = PairTiles()
    programs = gate_up_programs(pairs, inter, tiles)
    return dataclasses.replace(tiles, gate_up_split=2) if 2 * programs <= sms else tiles


def gate_up_programs(pairs: int, inter: int, tiles: PairTiles) -> int:
    """The gate|up launch's programs: one per (pair, tile of features, split of the columns)."""
    return pairs * triton.cdiv(inter, tiles.gate_up_n) * tiles.gate_up_split


def launches_early(pairs: int, inter: int, tiles: PairTiles, sms: int) -> bool:
    """Whether the pair path's three launches start early (PDL): where gate|up's programs are fewer than
    the ``sms`` multiprocessors, as the measured steps have them (see the module docstring). Where they
    fill the machine or more, the early programs of down pile onto the multiprocessors gate|up's last
    programs hold, as the skinny GEMMs' did (``docs/architecture.md``), and the steps measured slower."""
    return gate_up_programs(pairs, inter, tiles) < sms


def takes_pairs(x: torch.Tensor, scales: BlockScales | None, tiles: PairTiles | None = None) -> bool:
    """Whether :func:`fused_moe_pairs` runs ``x``'s routing: at most ``PAIR_TOKENS`` tokens
    (``PAIR_TOKENS_FP8`` with float8 experts, and only where each kernel tile sits inside one scale
    tile)."""
    if scales is None:
        return 0 < x.shape[0] <= PAIR_TOKENS
    t = tiles or PairTiles()
    rows, cols = scales.block
    return (
        0 < x.shape[0] <= PAIR_TOKENS_FP8
        and not scales.fp8_activations  # W8A8: the grouped path, which quantizes x and act in a pass
        and rows % t.gate_up_n == 0
        and rows % t.down_n == 0
        and cols % t.gate_up_k == 0
        and cols % t.down_k == 0
        and scales.offset % t.gate_up_n == 0
        and scales.offset % t.down_k == 0
    )


def fused_moe_pairs(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    *,
    scales: BlockScales | None = None,
    add: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    tiles: PairTiles | None = None,
    early: bool | None = None,
) -> torch.Tensor:
    """``ops.fused_moe`` for a few tokens (:func:`takes_pairs`), arguments as
    ``pegainfer.kernels.fused_moe.fused_moe_triton``; ``tiles`` is for the benchmark, ``early`` (default
    :func:`launches_early`) for the tests."""
    check_args(x, gate_up, down, scales, add, residual)
    tokens, hidden = x.shape
    top_k = ids.shape[1]
    inter = down.shape[2]
    pairs = tokens * top_k
    sms = num_sms(x.device)
    t = tiles or default_tiles(pairs, inter, sms)
    early = launches_early(pairs, inter, t, sms) if early is None else early
    if not takes_pairs(x, scales, t):
        raise ValueError(
            f"the pair path takes 1..{PAIR_TOKENS} tokens (float8: 1..{PAIR_TOKENS_FP8}, aligned scale "
            f"tiles), got {tokens}"
        )
    ids = ids.contiguous()
    weights = weights.contiguous()
    part = torch.empty(t.gate_up_split, pairs, 2 * inter, dtype=torch.float32, device=x.device)
    y = x.new_empty(pairs, hidden)
    quant = scales is not None
    gu_s = scales.gate_up if quant else x
    d_s = scales.down if quant else x
    block_rows, block_cols = scales.block if quant else (1, 1)
    offset = scales.offset if quant else 0
    flags = dict(
        QUANT=quant, BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols, SPLIT=t.gate_up_split,
        PREC=dot_precision(x.dtype), FIX=interp_bf16(x.dtype), num_warps=t.num_warps,
        **pdl_launch(x, early),
    )  # fmt: skip
    _pair_gate_up_kernel[(pairs, triton.cdiv(inter, t.gate_up_n), t.gate_up_split)](
        x, gate_up, ids, part, gu_s, pairs, hidden, inter, x.stride(0), gate_up.stride(0), gate_up.stride(1),
        gu_s.stride(0) if quant else 0, gu_s.stride(1) if quant else 0, gu_s.stride(2) if quant else 0,
        gu_s.stride(3) if quant else 0, offset,
        TOP_K=top_k, BLOCK_N=t.gate_up_n, BLOCK_K=t.gate_up_k, EVEN_K=hidden % t.gate_up_k == 0,
        num_stages=t.gate_up_stages, **flags,
    )  # fmt: skip
    _pair_down_kernel[(pairs, triton.cdiv(hidden, t.down_n))](
        part, down, ids, weights, y, d_s, pairs, hidden, inter, down.stride(0), down.stride(1),
        d_s.stride(0) if quant else 0, d_s.stride(1) if quant else 0, d_s.stride(2) if quant else 0, offset,
        BLOCK_N=t.down_n, BLOCK_K=t.down_k, EVEN_K=inter % t.down_k == 0, num_stages=t.down_stages, **flags,
    )  # fmt: skip
    return combine_choices(y, top_k, add, residual, early)
