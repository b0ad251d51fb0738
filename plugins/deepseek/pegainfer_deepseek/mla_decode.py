"""MLA decode attention over the paged latent cache, absorbed form: a Triton kernel and its torch reference.

The cache is ``[blocks, block_size, rkv + dr]``: per token the latent ``c`` (``rkv`` values) and the roped
shared key ``k_pe`` (``dr``); row ``b`` reads its first ``seq_lens[b]`` tokens through
``block_tables[b]``. The queries come absorbed, ``q_latent = W_UKᵀ q_nope`` ``[B, H, rkv]`` beside
``q_pe`` ``[B, H, dr]``: the scores are ``scale · (q_latent · c + q_pe · k_pe)`` and the result is the
probability-weighted sum of the latents, ``o_latent`` ``[B, H, rkv]`` (the caller applies W_UV). It is an
MQA with one shared key/value head of size ``rkv + dr`` (values: the first ``rkv``).

One program owns (``block_h`` heads, row, split), optionally only ``block_v`` of the output features
(then the programs of the other slices recompute the same scores): every latent tile it loads serves
``block_h`` heads through tensor-core dots, so a step reads each latent ``H / block_h`` times, all but the
first from L2 (the programs sharing a row's latents are adjacent in launch order). A row's context is
cut into ``num_splits`` chunks of whole ``BLOCK_N`` tiles; each program writes a partial (max, sum,
unnormalised acc) and the paged decode attention's ``decode_merge_kernel`` merges them (with one split the
first kernel writes the output).

Sparse rows (DeepSeek-V3.2's indexer selection): with ``indices`` ``[B, K]`` (int32 positions), a row
longer than ``K`` attends to exactly the ``K`` positions its row lists, in any order, each looked up
through the row's block table, so a step reads ``K`` latents of it, not ``seq_len``; a row of at most
``K`` tokens attends to all of them (the indexer keeps every position then) and ignores its indices.
The kernels see the lengths clamped to ``K`` (one device op), which the merge of the splits reads too.

CUDA-graph friendly: no host syncs; the grid depends on the batch, the heads and ``num_splits``, which
comes from static maxima (``max_seq_len``), never from the current lengths. Rows with ``seq_len == 0``
(padding) read nothing and get zeros.
"""

from __future__ import annotations

import math

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from pegainfer.kernels._triton import (
    cast_to,
    dot_precision,
    interp_bf16,
    mma,
    next_pow2,
    num_sms,
    tl,
    triton,
    use_kernel,
)
from pegainfer.kernels.paged_decode_attention import decode_merge_kernel

#: The merge kernel takes at most this many partials per row; chunks grow beyond it instead.
MAX_SPLITS = 32
#: A split covers at least this many tokens (its fixed cost: the queries' load and a partial's write).
MIN_TOKENS_PER_SPLIT = 128
#: Query heads per program: the M of its dots (16 is the smallest tensor-core tile).
BLOCK_H = 16
#: Programs of this kernel taken to run at once on a multiprocessor: two fits the sweep in
#: :func:`mla_decode_num_splits`'s docstring.
PROGRAMS_PER_SM = 2
#: The least share of a launch's last wave its programs must fill, for :func:`mla_decode_num_splits`.
MIN_WAVE_FILL = 0.9
#: Keys a tile of the TMA form's chunk tails (the smallest tensor-core K; ``tma`` tiles are multiples).
TMA_TAIL_N = 16


def mla_decode_num_splits(
    batch: int, num_heads: int, max_seq_len: int, device: torch.device, block_h: int = BLOCK_H
) -> int:
    """Splits per row from static sizes only: the fewest whose programs fill their last wave to
    ``MIN_WAVE_FILL`` (a wave: ``PROGRAMS_PER_SM`` programs on every multiprocessor), never more than
    ``max_seq_len`` has ``MIN_TOKENS_PER_SPLIT`` chunks for, at most ``MAX_SPLITS`` (the most allowed
    when none fills).

    Why waves: a row's splits share its work, so the step takes ``ceil(programs · splits / slots)`` waves
    of ``1 / splits`` of a row each; a half-empty last wave costs as much as a full one, and each split
    more adds a partial to write and merge. Measured on the H200 against the earlier rule (about four
    programs per SM), side by side (``bench/mla_splits.py``, 2026-12-04, no record): 128 heads at batch
    4 / 16 / 32 39.9 -> 34.7, 68.0 -> 56.4, 67.7 -> 53.4 us; 16 heads (a share under tp=8) at batch 16 /
    64 27.5 -> 22.9, 133.6 -> 120.0 us; batch 1 at 4096 tokens 26.1 -> 27.6 (30 splits, not 32), batch
    64 x 4096 at 128 heads 700.9 -> 706.2; the other cases equal. The 64-key, three-stage tiles fit one
    program a multiprocessor, but counting one instead of two measured mixed (2026-12-04, no record:
    faster at 16 heads x batch 16-32, slower at batch 64 and at 128 heads x batch 4-16), so the rule stays."""
    programs = max(1, batch * triton.cdiv(num_heads, block_h))
    slots = PROGRAMS_PER_SM * num_sms(device)
    most = max(1, min(math.ceil(max(1, max_seq_len) / MIN_TOKENS_PER_SPLIT), MAX_SPLITS))
    for splits in range(1, most + 1):
        launched = programs * splits
        if launched / (slots * math.ceil(launched / slots)) >= MIN_WAVE_FILL:
            return splits
    return most


@triton.jit
def _split_range(seq_lens_ptr, row, split, num_splits, BLOCK_N: tl.constexpr):
    """(length, start, end) of chunk ``split`` of ``row``: the row's context cut into ``num_splits``
    chunks of whole ``BLOCK_N`` tiles (the last ones may be short or empty)."""
    seq_len = tl.load(seq_lens_ptr + row)
    chunk = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    return seq_len, start, tl.minimum(start + chunk, seq_len)


@triton.jit
def _tile_tokens(
    table, n0, offs_n, valid, stride_cblk, stride_ctok, PAGE: tl.constexpr, BLOCK_N: tl.constexpr
):
    """Cache offsets of the tile of positions ``offs_n`` (from ``n0``) of a row whose pages ``table`` lists."""
    if PAGE % BLOCK_N == 0:
        # Tiles start at multiples of BLOCK_N (so do the chunks): the whole tile sits in one page, one
        # table entry and one contiguous run of the cache.
        block = tl.load(table + n0 // PAGE).to(tl.int64)
        tok = block * stride_cblk + (n0 % PAGE + tl.arange(0, BLOCK_N)) * stride_ctok
    else:
        block = tl.load(table + offs_n // PAGE, mask=valid, other=0).to(tl.int64)
        tok = block * stride_cblk + (offs_n % PAGE) * stride_ctok
    return tok


@triton.jit
def _attend(
    q, qp, cache_ptr, table, idx, start, end, scale_log2, stride_cblk, stride_ctok, offs_r, offs_p, offs_v,
    mask_r, mask_p, mask_v, RKV: tl.constexpr, PAGE: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_V: tl.constexpr, V_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, GATHER: tl.constexpr,
    DOT_PREC: tl.constexpr, FIX: tl.constexpr,
):  # fmt: skip
    """Online softmax of the queries ``q``/``qp`` over positions ``[start, end)`` of a row: its running
    max, sum and unnormalised output. ``GATHER``: position ``n`` is the ``n``-th the row's indices list
    (``idx``), else the row's ``n``-th token."""
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_V], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        valid = offs_n < end
        if GATHER:
            pos = tl.load(idx + offs_n, mask=valid, other=0)
            block = tl.load(table + pos // PAGE, mask=valid, other=0).to(tl.int64)
            tok = block * stride_cblk + (pos % PAGE) * stride_ctok
        else:
            tok = _tile_tokens(table, n0, offs_n, valid, stride_cblk, stride_ctok, PAGE, BLOCK_N)
        c = tl.load(
            cache_ptr + tok[:, None] + offs_r[None, :], mask=valid[:, None] & mask_r[None, :], other=0.0
        )
        kp = tl.load(
            cache_ptr + tok[:, None] + RKV + offs_p[None, :], mask=valid[:, None] & mask_p[None, :], other=0.0
        )
        s = (mma(q, tl.trans(c), FIX, DOT_PREC) + mma(qp, tl.trans(kp), FIX, DOT_PREC)) * scale_log2
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: a tile holds at least one key
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if V_SPLITS == 1:
            cv = c
        else:  # this program's slice of the tile it just read (from L1/L2)
            cv = tl.load(
                cache_ptr + tok[:, None] + offs_v[None, :], mask=valid[:, None] & mask_v[None, :], other=0.0
            )
        acc = acc * alpha[:, None] + mma(cast_to(p, c.dtype, FIX), cv, FIX, DOT_PREC)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _mla_decode_partial_kernel(
    q_lat_ptr,
    q_pe_ptr,
    cache_ptr,
    tables_ptr,
    seq_lens_ptr,
    idx_ptr,
    out_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    scale_log2,
    num_splits,
    num_heads,
    num_indices,
    stride_qb,
    stride_qh,
    stride_pb,
    stride_ph,
    stride_cblk,
    stride_ctok,
    stride_bt,
    stride_ib,
    stride_ob,
    stride_oh,
    RKV: tl.constexpr,
    DR: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_V: tl.constexpr,
    V_SPLITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    SPARSE: tl.constexpr,
    DOT_PREC: tl.constexpr,
    FIX: tl.constexpr,
):
    # Head blocks vary fastest in launch order: the programs sharing a row's latents run side by side and
    # all but the first read them from L2.
    head_block = tl.program_id(0) // V_SPLITS
    v_split = tl.program_id(0) % V_SPLITS
    row = tl.program_id(1)
    split = tl.program_id(2)
    seq_len, start, end = _split_range(seq_lens_ptr, row, split, num_splits, BLOCK_N)
    row64 = row.to(tl.int64)
    # Lengths come clamped to num_indices: a full-length row is longer than its selection (or as long,
    # when both forms read the same positions) and reads the positions its indices list.
    gather = seq_len >= num_indices

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_P)
    offs_v = v_split * BLOCK_V + tl.arange(0, BLOCK_V)  # the output features this program accumulates
    mask_h = heads < num_heads
    mask_r = offs_r < RKV
    mask_p = offs_p < DR
    mask_v = offs_v < RKV
    mask_hv = mask_h[:, None] & mask_v[None, :]
    out_ptrs = out_ptr + row64 * stride_ob + heads[:, None] * stride_oh + offs_v[None, :]
    if start < seq_len:
        q = tl.load(
            q_lat_ptr + row64 * stride_qb + heads[:, None] * stride_qh + offs_r[None, :],
            mask=mask_h[:, None] & mask_r[None, :],
            other=0.0,
        )
        qp = tl.load(
            q_pe_ptr + row64 * stride_pb + heads[:, None] * stride_ph + offs_p[None, :],
            mask=mask_h[:, None] & mask_p[None, :],
            other=0.0,
        )
        table = tables_ptr + row64 * stride_bt
        idx = idx_ptr + row64 * stride_ib  # dense launches pass a stand-in pointer, never read
        # The form is chosen once a program, outside the loop: a branch inside it kept Triton from
        # pipelining the loads of either form.
        if SPARSE:
            if gather:
                m_i, l_i, acc = _attend(
                    q, qp, cache_ptr, table, idx, start, end, scale_log2, stride_cblk, stride_ctok, offs_r, offs_p,
                    offs_v, mask_r, mask_p, mask_v, RKV, PAGE, BLOCK_H, BLOCK_V, V_SPLITS, BLOCK_N, True, DOT_PREC, FIX,
                )  # fmt: skip
            else:
                m_i, l_i, acc = _attend(
                    q, qp, cache_ptr, table, idx, start, end, scale_log2, stride_cblk, stride_ctok, offs_r, offs_p,
                    offs_v, mask_r, mask_p, mask_v, RKV, PAGE, BLOCK_H, BLOCK_V, V_SPLITS, BLOCK_N, False, DOT_PREC, FIX,
                )  # fmt: skip
        else:
            m_i, l_i, acc = _attend(
                q, qp, cache_ptr, table, idx, start, end, scale_log2, stride_cblk, stride_ctok, offs_r, offs_p,
                offs_v, mask_r, mask_p, mask_v, RKV, PAGE, BLOCK_H, BLOCK_V, V_SPLITS, BLOCK_N, False, DOT_PREC, FIX,
            )  # fmt: skip
        if SPLIT:
            part = (row64 * num_heads + heads) * num_splits + split
            tl.store(part_m_ptr + part, m_i, mask=mask_h)
            tl.store(part_l_ptr + part, l_i, mask=mask_h)
            tl.store(part_acc_ptr + part[:, None] * RKV + offs_v[None, :], acc, mask=mask_hv)
        else:
            o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(out_ptrs, cast_to(o, out_ptr.dtype.element_ty, FIX), mask=mask_hv)
    else:
        if not SPLIT:  # only split 0 exists, so this row is padding (seq_len 0): zeros
            zeros = tl.zeros([BLOCK_H, BLOCK_V], tl.float32)
            tl.store(out_ptrs, cast_to(zeros, out_ptr.dtype.element_ty, FIX), mask=mask_hv)


@triton.jit
def _tma_tile(c_desc, p_desc, table, n0, own, other, PAGE: tl.constexpr, HALF: tl.constexpr):
    """A tile's latents in two halves, the program's own output half first, and its rope keys: three TMA
    loads of one page's rows."""
    r = tl.load(table + n0 // PAGE) * PAGE + n0 % PAGE
    return c_desc.load([r, own]), c_desc.load([r, other]), p_desc.load([r, 2 * HALF])


@triton.jit
def _tma_step(
    q0, q1, qp, c0, c1, kp, m_i, l_i, acc0, acc1, scale_log2, valid, BOTH: tl.constexpr, TAIL: tl.constexpr,
    DOT_PREC: tl.constexpr, FIX: tl.constexpr,
):  # fmt: skip
    """One tile of the online softmax over both latent halves; the output of the first half (``acc0``) and,
    with ``BOTH``, of the second (``acc1``, else left as it is). ``TAIL``: keys past the row's end (read by
    the TMA box, whatever they hold) masked out of the scores and zeroed out of the values."""
    s = mma(q0, tl.trans(c0), FIX, DOT_PREC) + mma(q1, tl.trans(c1), FIX, DOT_PREC)
    s = (s + mma(qp, tl.trans(kp), FIX, DOT_PREC)) * scale_log2
    if TAIL:
        s = tl.where(valid[None, :], s, float("-inf"))
        c0 = tl.where(valid[:, None], c0, 0.0)
        c1 = tl.where(valid[:, None], c1, 0.0)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    p = cast_to(p, c0.dtype, FIX)
    acc0 = acc0 * alpha[:, None] + mma(p, c0, FIX, DOT_PREC)
    if BOTH:
        acc1 = acc1 * alpha[:, None] + mma(p, c1, FIX, DOT_PREC)
    return m_new, l_i, acc0, acc1


@triton.jit
def _mla_decode_tma_kernel(
    q_desc, qp_desc, c_desc, p_desc, ct_desc, pt_desc, tables_ptr, seq_lens_ptr, out_ptr, part_acc_ptr,
    part_m_ptr, part_l_ptr, scale_log2, num_splits, num_heads, stride_bt, stride_ob, stride_oh,
    PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, TAIL_N: tl.constexpr, HALF: tl.constexpr,
    DR: tl.constexpr, HALVES: tl.constexpr, SPLIT: tl.constexpr, NUM_STAGES: tl.constexpr,
    DOT_PREC: tl.constexpr, FIX: tl.constexpr,
):  # fmt: skip
    """The dense rows' kernel with TMA tile loads (see ``mla_decode_attention_triton``'s ``tma``): the
    same programs and partials as ``_mla_decode_partial_kernel``, whole tiles without masks, the chunk's
    last keys apart in ``TAIL_N``-key tiles (``ct_desc``, ``pt_desc``). ``HALVES`` 2: a program
    accumulates one half of the output features (its neighbour in launch order the other, from the same
    scores)."""
    head_block = tl.program_id(0) // HALVES
    own = (tl.program_id(0) % HALVES) * HALF  # the first output feature this program accumulates
    other = HALF - own
    row = tl.program_id(1)
    split = tl.program_id(2)
    seq_len, start, end = _split_range(seq_lens_ptr, row, split, num_splits, BLOCK_N)
    row64 = row.to(tl.int64)
    h0 = head_block * BLOCK_H
    heads = h0 + tl.arange(0, BLOCK_H)
    offs = tl.arange(0, HALF)
    out_ptrs = out_ptr + row64 * stride_ob + heads[:, None] * stride_oh + offs[None, :]
    if start < seq_len:
        q0 = q_desc.load([row, h0, own]).reshape(BLOCK_H, HALF)
        q1 = q_desc.load([row, h0, other]).reshape(BLOCK_H, HALF)
        qp = qp_desc.load([row, h0, 0]).reshape(BLOCK_H, DR)
        table = tables_ptr + row64 * stride_bt
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc0 = tl.zeros([BLOCK_H, HALF], tl.float32)
        acc1 = tl.zeros([BLOCK_H, HALF], tl.float32)  # unused (and dropped) with HALVES 2
        whole_end = start + (end - start) // BLOCK_N * BLOCK_N
        every = tl.full([BLOCK_N], True, tl.int1)
        for n0 in tl.range(start, whole_end, BLOCK_N, num_stages=NUM_STAGES):
            c0, c1, kp = _tma_tile(c_desc, p_desc, table, n0, own, other, PAGE, HALF)
            m_i, l_i, acc0, acc1 = _tma_step(
                q0, q1, qp, c0, c1, kp, m_i, l_i, acc0, acc1, scale_log2, every, HALVES == 1, False, DOT_PREC,
                FIX,
            )  # fmt: skip
        # The chunk's last keys in TAIL_N-key tiles: the masked values of a small tile pass through
        # registers, a whole tile's would push the kernel past its register budget (spills).
        for n0 in range(whole_end, end, TAIL_N):
            c0, c1, kp = _tma_tile(ct_desc, pt_desc, table, n0, own, other, PAGE, HALF)
            valid = n0 + tl.arange(0, TAIL_N) < end
            m_i, l_i, acc0, acc1 = _tma_step(
                q0, q1, qp, c0, c1, kp, m_i, l_i, acc0, acc1, scale_log2, valid, HALVES == 1, True, DOT_PREC,
                FIX,
            )  # fmt: skip
        if SPLIT:
            part = (row64 * num_heads + heads) * num_splits + split
            if own == 0:  # the two halves' programs computed the same max and sum
                tl.store(part_m_ptr + part, m_i)
                tl.store(part_l_ptr + part, l_i)
            part_ptrs = part_acc_ptr + part[:, None] * (2 * HALF) + offs[None, :]
            tl.store(part_ptrs + own, acc0)
            if HALVES == 1:
                tl.store(part_ptrs + other, acc1)
        else:
            inv = 1.0 / tl.where(l_i > 0, l_i, 1.0)
            tl.store(out_ptrs + own, cast_to(acc0 * inv[:, None], out_ptr.dtype.element_ty, FIX))
            if HALVES == 1:
                tl.store(out_ptrs + other, cast_to(acc1 * inv[:, None], out_ptr.dtype.element_ty, FIX))
    else:
        if not SPLIT:  # only split 0 exists, so this row is padding (seq_len 0): zeros
            zeros = cast_to(tl.zeros([BLOCK_H, HALF], tl.float32), out_ptr.dtype.element_ty, FIX)
            tl.store(out_ptrs + own, zeros)
            if HALVES == 1:
                tl.store(out_ptrs + other, zeros)


def mla_decode_attention_ref(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_seq_len: int,
    indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """The torch reference: the latents of every row gathered up to ``max_seq_len``, a masked softmax
    (rows longer than the ``indices`` they come with: only the listed positions unmasked)."""
    rkv, block_size = q_latent.shape[-1], cache.shape[1]
    positions = torch.arange(max(1, max_seq_len), device=q_latent.device)
    slots = block_tables[:, positions // block_size].long() * block_size + positions % block_size
    latent = cache.flatten(0, 1)[slots]  # [B, L, rkv + dr]
    queries = torch.cat([q_latent, q_pe], dim=-1)
    scores = torch.einsum("bhr,blr->bhl", queries, latent) * scale
    valid = positions[None, :] < seq_lens[:, None]
    if indices is not None:
        listed = torch.zeros_like(valid).scatter_(1, indices.long().clamp(0, positions.numel() - 1), True)
        valid = valid & (listed | (seq_lens <= indices.shape[1])[:, None])
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).nan_to_num(0.0).to(latent.dtype)
    return torch.einsum("bhl,blr->bhr", probs, latent[..., :rkv])


def mla_decode_attention_triton(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_seq_len: int,
    indices: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_h: int = BLOCK_H,
    block_v: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
    tma: bool = False,
) -> torch.Tensor:
    """The Triton path of :func:`mla_decode_attention`; the keyword knobs are for the benchmark:
    ``block_h`` query heads a program (the M of its dots), ``block_v`` the output features it accumulates
    (None: all; fewer splits the ``block_h × rkv`` accumulator over programs that each recompute the
    scores), ``block_n`` keys a tile. ``tma`` (dense rows, tiles inside a page, ``heads`` a multiple of
    ``block_h``, power-of-two ``rkv / 2`` and ``dr``): tiles loaded by the tensor-memory accelerator
    through descriptors, the output in two ``rkv / 2`` halves (two accumulators), so a ``block_h`` of 64
    (one warpgroup's M) holds its accumulators in eight warps' registers: at 128 heads each latent is read
    twice rather than eight times (16 heads a program). The dispatch takes it with ``TMA_TILING`` where
    :func:`mla_decode_tiling` says (its docstring has the measurements); one stage measured only 7% faster
    than the defaults (405.4 against 435.4 us, H100), two stages 1.40x. With
    ``block_v`` half of ``rkv`` a program accumulates one half (two programs a head block, the scores
    computed by both): one warpgroup's registers hold a 64-head half, and 16-key tiles in two stages fit
    two programs a multiprocessor. Compiled for sm_90a (Triton 3.6, offline), the one-stage forms wait
    for each of a tile's three loads in turn, and with 64 heads over eight warps every warpgroup computes
    all 64 heads' scores (Triton gives a chained dot's warps to its rows), then trades the
    probabilities through shared memory.

    The defaults follow the page size (H200, batch 64 x 4096 tokens, side by side with the per-key
    gather of every tile before, 2026-12-04, no record: the sweep is in docs/benchmarks.md): pages of 64
    tokens or more take 64-key tiles, each inside one page and read as one contiguous run, with three
    loads in flight: 16 heads 115.5 -> 90.1 us (80% of the copy rate), 128 heads 703.2 -> 443.0 us.
    Smaller pages (the engine's default 16) keep 32-key tiles, two loads, a page looked up per key
    (116.9 us at 16 heads); 16-key tiles inside a 16-token page measured 147.6 and a 64-key tile of four
    pages (the table entries broadcast over each page's keys) 2191."""
    batch, heads, rkv = q_latent.shape
    dr = q_pe.shape[-1]
    if cache.dim() != 3 or cache.shape[-1] != rkv + dr:
        raise ValueError(f"cache {tuple(cache.shape)} is not [blocks, block_size, {rkv} + {dr}]")
    page = cache.shape[1]
    block_n = block_n or (64 if page % 64 == 0 else 32)
    num_stages = num_stages or (3 if page % block_n == 0 else 2)
    if block_n < 16:  # the p · latents dot takes block_n as its K
        raise ValueError(f"block_n {block_n}: compiled tensor-core dots need at least 16 keys a tile")
    fits = tma_fits(heads, rkv, dr, page, indices is not None, block_h, block_n)
    if tma and (not fits or block_v not in (None, rkv // 2)):
        raise ValueError(
            f"tma needs dense rows, whole tiles in a page ({block_n} keys, pages of {page}), heads ({heads}) "
            f"a multiple of block_h ({block_h}), power-of-two halves of rkv ({rkv}) and dr ({dr}) and "
            f"block_v ({block_v}) None or half of rkv"
        )
    operands = [("q_latent", q_latent), ("q_pe", q_pe), ("cache", cache), ("block_tables", block_tables)]
    for name, t in operands + ([("indices", indices)] if indices is not None else []):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dimension")
    out = torch.empty_like(q_latent)
    if batch == 0:
        return out
    if indices is not None:
        if indices.dtype != torch.int32 or indices.shape[0] != batch:
            raise ValueError(f"indices {indices.dtype} {tuple(indices.shape)}: need int32 [{batch}, K]")
        # A row reads at most K latents: the splits and the merge see the clamped lengths.
        max_seq_len = min(max_seq_len, indices.shape[1])
        seq_lens = seq_lens.clamp(max=indices.shape[1])
    splits = num_splits or mla_decode_num_splits(batch, heads, max_seq_len, q_latent.device, block_h)
    split = splits > 1
    f32 = torch.float32
    part_acc = torch.empty((batch, heads, splits, rkv) if split else (1,), dtype=f32, device=out.device)
    part_m = torch.empty((batch, heads, splits) if split else (1,), dtype=f32, device=out.device)
    part_l = torch.empty_like(part_m)
    fix = interp_bf16(q_latent.dtype)
    # Compiled tensor-core dots need K >= 16: small (test) widths pad their tiles, masked.
    block_r = max(16, next_pow2(rkv))
    block_v = min(block_v or block_r, block_r)
    v_splits = block_r // block_v
    if tma:
        _launch_tma(q_latent, q_pe, cache, block_tables, seq_lens, out, part_acc, part_m, part_l, scale, splits,
                    block_h, v_splits, block_n, num_warps, num_stages)  # fmt: skip
    else:
        _mla_decode_partial_kernel[(triton.cdiv(heads, block_h) * v_splits, batch, splits)](
            q_latent, q_pe, cache, block_tables, seq_lens, indices if indices is not None else seq_lens, out,
            part_acc, part_m, part_l, scale * math.log2(math.e), splits, heads,
            indices.shape[1] if indices is not None else 0,
            q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1), cache.stride(0),
            cache.stride(1), block_tables.stride(0), indices.stride(0) if indices is not None else 0,
            out.stride(0), out.stride(1),
            RKV=rkv, DR=dr, BLOCK_R=block_r, BLOCK_P=max(16, next_pow2(dr)), PAGE=page, BLOCK_H=block_h,
            BLOCK_V=block_v, V_SPLITS=v_splits, BLOCK_N=block_n, SPLIT=split, SPARSE=indices is not None, DOT_PREC=dot_precision(q_latent.dtype),
            FIX=fix, num_warps=num_warps, num_stages=num_stages,
        )  # fmt: skip
    if split:
        decode_merge_kernel[(batch, heads)](
            part_acc, part_m, part_l, seq_lens, out, out, splits, heads, out.stride(0), out.stride(1), 0, 0,
            HEAD_DIM=rkv, BLOCK_D=block_r, BLOCK_S=max(2, next_pow2(splits)), BLOCK_N=block_n, FIX=fix,
            PDL=False, ALL_SPLITS=False, GATE=False, num_warps=4,
        )  # fmt: skip
    return out


def _launch_tma(q_latent, q_pe, cache, block_tables, seq_lens, out, part_acc, part_m, part_l, scale, splits,
                block_h, halves, block_n, num_warps, num_stages):  # fmt: skip
    """``_mla_decode_tma_kernel`` over descriptors of the queries (their own strides: the absorbed
    queries come transposed) and of the cache's rows, one page's tokens a run; ``halves`` programs a
    head block (2: one output half each)."""
    batch, heads, rkv = q_latent.shape
    dr, page, half = q_pe.shape[-1], cache.shape[1], rkv // 2
    rows = cache.view(-1, rkv + dr)

    def desc(t, block):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), block)

    tail_n = min(block_n, TMA_TAIL_N)
    _mla_decode_tma_kernel[(heads // block_h * halves, batch, splits)](
        desc(q_latent, [1, block_h, half]), desc(q_pe, [1, block_h, dr]), desc(rows, [block_n, half]),
        desc(rows, [block_n, dr]), desc(rows, [tail_n, half]), desc(rows, [tail_n, dr]), block_tables, seq_lens,
        out, part_acc, part_m, part_l, scale * math.log2(math.e), splits, heads, block_tables.stride(0),
        out.stride(0), out.stride(1), PAGE=page, BLOCK_H=block_h, BLOCK_N=block_n, TAIL_N=tail_n, HALF=half,
        DR=dr, HALVES=halves, SPLIT=splits > 1, NUM_STAGES=num_stages, DOT_PREC=dot_precision(q_latent.dtype),
        FIX=interp_bf16(q_latent.dtype), num_warps=num_warps,
    )  # fmt: skip


#: The TMA form's tiling, taken where it applies (:func:`mla_decode_tiling`).
TMA_TILING = dict(block_h=64, block_n=64, num_warps=8, num_stages=2, tma=True)
#: The least ``heads x rows x max_seq_len`` a launch takes ``TMA_TILING`` for (2^23).
TMA_MIN_WORK = 1 << 23


def mla_decode_tiling(
    heads: int, rows: int, max_seq_len: int, rkv: int, dr: int, page: int, sparse: bool, device: torch.device
) -> dict:
    """The knobs :func:`mla_decode_attention` gives the Triton kernel: ``TMA_TILING`` for dense rows of
    a multiple of 64 heads over pages of a multiple of 64 tokens on Hopper or later (power-of-two
    ``rkv / 2`` and ``dr``) with at least ``TMA_MIN_WORK`` head-tokens, else the kernel's defaults.

    Measured on an H100 (side by side in one process, no record; scratch sweep, 2026-12-08): at 128
    heads, batch 64 x 4096, 305.3 us against the defaults' 428.2 (1.40x; the TMA form with one stage
    took 416.3: its second stage lets the next tile's loads fly under the dots, which the 16-key tail
    tiles made possible, a whole masked tail tile having spilled registers); 1.07-1.56x from 2^23
    head-tokens up (128 heads from batch x context 65536, 64 heads from 131072), 0.76-0.97x below (128
    heads at batch 4 x 4096 or 16 x 1024 0.76x; 64 heads at batch 1 x 16384 0.69x). ``max_seq_len`` is
    the static bound the caller passes (a graph's), so a graph of long admitted contexts takes the TMA
    form for short ones too."""
    fits = tma_fits(heads, rkv, dr, page, sparse, TMA_TILING["block_h"], TMA_TILING["block_n"])
    if not fits or heads * rows * max_seq_len < TMA_MIN_WORK or device.type != "cuda" or not _has_tma(device):
        return {}
    return dict(TMA_TILING)


def tma_fits(heads: int, rkv: int, dr: int, page: int, sparse: bool, block_h: int, block_n: int) -> bool:
    """Whether the TMA form can load these operands: dense rows, ``block_n``-key tiles inside a page,
    heads a multiple of ``block_h``, power-of-two halves of ``rkv`` and a power-of-two ``dr``."""
    half = rkv // 2
    return not (
        sparse
        or page % block_n
        or heads % block_h
        or rkv % 2
        or next_pow2(half) != half
        or next_pow2(dr) != dr
    )


_TMA: dict[int, bool] = {}


def _has_tma(device: torch.device) -> bool:
    """Whether ``device`` (CUDA) has the tensor-memory accelerator (Hopper on); cached, as every decode
    layer asks."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _TMA:
        _TMA[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return _TMA[index]


def mla_decode_attention(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_seq_len: int,
    indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """``o_latent`` ``[B, H, rkv]`` of the absorbed decode rows (see the module docstring; ``indices``:
    the sparse rows' positions): Triton on CUDA, the torch reference elsewhere. ``max_seq_len`` bounds
    every ``seq_lens`` entry (a static maximum is fine: it only sizes the splits and the reference's
    gather)."""
    if use_kernel(q_latent):
        rows, heads, rkv = q_latent.shape
        tiling = mla_decode_tiling(
            heads,
            rows,
            max_seq_len,
            rkv,
            q_pe.shape[-1],
            cache.shape[1],
            indices is not None,
            q_latent.device,
        )
        return mla_decode_attention_triton(
            q_latent, q_pe, cache, block_tables, seq_lens, scale, max_seq_len=max_seq_len, indices=indices,
            **tiling,
        )  # fmt: skip
    return mla_decode_attention_ref(
        q_latent, q_pe, cache, block_tables, seq_lens, scale, max_seq_len=max_seq_len, indices=indices
    )
