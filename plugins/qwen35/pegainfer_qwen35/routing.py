"""Qwen3.5-MoE's expert selection from the router's logits: a Triton kernel and its torch reference.

From logits ``[T, E + 1]`` (a strided view of the router GEMM's output is fine; the last column is the
shared expert's gate logit): ``p = softmax(logits[:, :E])`` in fp32, the ``k`` largest ``p`` (ids best
first), renormalised to sum to 1 when ``norm``, cast to ``dtype``; then ``shared`` more columns, the shared
expert's pieces (``SparseMoE``: experts ``E .. E + shared - 1``), each weighted ``sigmoid(gate logit)`` in
``dtype``. The kernel is one program per token for all of it, where the torch form is some eight launches a
layer, paid in latency by a batch-1 decode step; it has no host sync, so it runs inside CUDA graphs. Ties
between equal probabilities go to the lower index (torch's ``topk`` leaves their order open).
"""

from __future__ import annotations

import torch

from pegainfer.kernels._triton import cast_to, interp_bf16, next_pow2, pdl_launch, pdl_start, tl, triton
from pegainfer.ops import use_triton
from pegainfer_qwen35.norms import rms_norm_zero_centred

#: Most rows :func:`norm_route_topk` takes in its one launch: each row's programs read the whole router
#: (from L2 after the first row), so more rows keep the norm, cuBLAS's GEMM and the selection launch.
ROUTE_ROWS = 4
#: Router rows per program of :func:`norm_route_topk`.
ROUTER_ROWS_PER_PROGRAM = 8
#: Hidden features a loop step of :func:`norm_route_topk` loads.
ROUTE_CHUNK = 512

_WORKSPACES: dict[tuple[torch.device, int], tuple[torch.Tensor, torch.Tensor]] = {}


def softmax_topk_ref(
    logits: torch.Tensor, k: int, norm: bool, dtype: torch.dtype, shared: int
) -> tuple[torch.Tensor, torch.Tensor]:
    experts = logits.shape[1] - 1
    probs = torch.softmax(logits[:, :experts], dim=-1, dtype=torch.float32)
    weights, ids = probs.topk(k, dim=-1)
    if norm:
        weights = weights / weights.sum(-1, keepdim=True)
    gate = torch.sigmoid(logits[:, experts:].float()).to(dtype).expand(-1, shared)
    shared_ids = torch.arange(experts, experts + shared, device=logits.device).expand(len(logits), -1)
    return torch.cat([weights.to(dtype), gate], 1), torch.cat([ids, shared_ids], 1)


@triton.jit
def _select(
    logit,
    gate_logit,
    weights_ptr,
    ids_ptr,
    token,
    NUM_EXPERTS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    K: tl.constexpr,
    SHARED: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NORM: tl.constexpr,
):
    """One token's selection from its fp32 expert logits ``[BLOCK_E]`` (-inf past the experts) and the
    shared gate's logit: its ``K + SHARED`` weights and ids stored at row ``token``."""
    expert = tl.arange(0, BLOCK_E)
    valid = expert < NUM_EXPERTS
    e = tl.exp(logit - tl.max(logit, 0))
    probs = e / tl.sum(e, 0)
    choice = tl.where(valid, probs, -1.0)  # below every probability: padding is never picked
    slot = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    weights = tl.zeros([BLOCK_K], dtype=tl.float32)
    for i in tl.static_range(K):
        top = tl.max(choice, 0)
        pick = tl.min(tl.where(choice == top, expert, BLOCK_E), 0)
        ids = tl.where(slot == i, pick, ids)
        weights = tl.where(slot == i, top, weights)
        choice = tl.where(expert == pick, -2.0, choice)
    if NORM:
        weights = weights / tl.sum(weights, 0)
    dtype = weights_ptr.dtype.element_ty
    # Slots K .. K + SHARED - 1: the shared expert's pieces, gated as one.
    gate = 1.0 / (1.0 + tl.exp(-gate_logit))
    is_shared = (slot >= K) & (slot < K + SHARED)
    weights = tl.where(slot < K, weights.to(dtype), tl.where(is_shared, gate.to(dtype), 0.0).to(dtype))
    ids = tl.where(is_shared, NUM_EXPERTS + slot - K, ids)
    out = token * (K + SHARED) + slot
    tl.store(weights_ptr + out, weights, mask=slot < K + SHARED)
    tl.store(ids_ptr + out, ids.to(tl.int64), mask=slot < K + SHARED)


@triton.jit
def _softmax_topk_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    stride_l,
    NUM_EXPERTS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    K: tl.constexpr,
    SHARED: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NORM: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_start(PDL)
    token = tl.program_id(0).to(tl.int64)
    row = logits_ptr + token * stride_l
    expert = tl.arange(0, BLOCK_E)
    logit = tl.load(row + expert, mask=expert < NUM_EXPERTS, other=float("-inf")).to(tl.float32)
    gate_logit = tl.load(row + NUM_EXPERTS).to(tl.float32)
    _select(logit, gate_logit, weights_ptr, ids_ptr, token, NUM_EXPERTS, BLOCK_E, K, SHARED, BLOCK_K, NORM)


def softmax_topk_triton(
    logits: torch.Tensor, k: int, norm: bool, dtype: torch.dtype, shared: int
) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, columns = logits.shape
    experts = columns - 1
    if logits.stride(-1) != 1 or not 0 < k <= experts:
        raise ValueError(
            f"softmax_topk: logits {tuple(logits.shape)} (E + 1 columns) need a contiguous last dim and k <= E"
        )
    weights = torch.empty(tokens, k + shared, dtype=dtype, device=logits.device)
    ids = torch.empty(tokens, k + shared, dtype=torch.int64, device=logits.device)
    if tokens:
        _softmax_topk_kernel[(tokens,)](
            logits, weights, ids, logits.stride(0), NUM_EXPERTS=experts, BLOCK_E=next_pow2(experts), K=k,
            SHARED=shared, BLOCK_K=max(2, next_pow2(k + shared)), NORM=norm,
            num_warps=4 if experts > 64 else 1, **pdl_launch(logits),
        )  # fmt: skip
    return weights, ids


def softmax_topk(
    logits: torch.Tensor, k: int, norm: bool, dtype: torch.dtype, shared: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights ``[T, k + shared]`` in ``dtype``, ids ``[T, k + shared]`` int64) of the module docstring:
    the kernel on CUDA (unless ``PEGAINFER_DISABLE_TRITON``), the torch reference elsewhere."""
    select = softmax_topk_triton if use_triton(logits) else softmax_topk_ref
    return select(logits, k, norm, dtype, shared)


@triton.jit
def _norm_route_kernel(
    x_ptr,
    norm_w_ptr,
    router_ptr,
    normed_ptr,
    logits_ptr,
    count_ptr,
    weights_ptr,
    ids_ptr,
    hidden,
    stride_x,
    stride_r,
    stride_n,
    eps,
    NUM_EXPERTS: tl.constexpr,
    ROWS: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_E: tl.constexpr,
    K: tl.constexpr,
    SHARED: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NORM: tl.constexpr,
    FIX: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (token, part): the token's zero-centred norm (part 0 stores it), the router logits of the
    part's ``ROWS`` rows (rounded to the model dtype, as the GEMM's output is) into the workspace; the
    token's last part to arrive (its counter) selects from all of them, and resets the counter."""
    pdl_start(PDL)
    token = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    dtype: tl.constexpr = x_ptr.dtype.element_ty
    x_row = x_ptr + token * stride_x
    cols = tl.arange(0, CHUNK)
    sq = tl.zeros([CHUNK], tl.float32)
    for h in range(0, hidden, CHUNK):
        xv = tl.load(x_row + h + cols, mask=h + cols < hidden, other=0.0).to(tl.float32)
        sq += xv * xv
    rstd = tl.rsqrt(tl.sum(sq, 0) / hidden + eps)
    rows = part * ROWS + tl.arange(0, ROWS)
    rows_ok = rows < NUM_EXPERTS + 1
    r_ptrs = router_ptr + rows[:, None].to(tl.int64) * stride_r + cols[None, :]
    acc = tl.zeros([ROWS, CHUNK], tl.float32)
    for h in range(0, hidden, CHUNK):
        ok = h + cols < hidden
        xv = tl.load(x_row + h + cols, mask=ok, other=0.0).to(tl.float32)
        w = tl.load(norm_w_ptr + h + cols, mask=ok, other=0.0).to(tl.float32)
        normed = cast_to(xv * rstd * (1.0 + w), dtype, FIX)
        if part == 0:
            tl.store(normed_ptr + token * stride_n + h + cols, normed, mask=ok)
        r = tl.load(r_ptrs + h, mask=rows_ok[:, None] & ok[None, :], other=0.0)
        acc += r.to(tl.float32) * normed.to(tl.float32)[None, :]
    logit_row = logits_ptr + token * (NUM_EXPERTS + 1)
    tl.store(logit_row + rows, cast_to(tl.sum(acc, 1), dtype, FIX).to(tl.float32), mask=rows_ok)
    # Every thread's logits are stored before the counter's release (one thread's atomic).
    tl.debug_barrier()
    if tl.atomic_add(count_ptr + token, 1, sem="acq_rel") == tl.num_programs(1) - 1:
        expert = tl.arange(0, BLOCK_E)
        # .cg: from L2, where the other programs' stores are, never a stale L1 line.
        logit = tl.load(
            logit_row + expert, mask=expert < NUM_EXPERTS, other=float("-inf"), cache_modifier=".cg"
        )
        gate_logit = tl.load(logit_row + NUM_EXPERTS, cache_modifier=".cg")
        _select(
            logit, gate_logit, weights_ptr, ids_ptr, token, NUM_EXPERTS, BLOCK_E, K, SHARED, BLOCK_K, NORM
        )
        tl.atomic_xchg(count_ptr + token, 0, sem="relaxed")


def _workspace(device: torch.device, columns: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 logits and the per-row arrival counters (zero between launches) of :func:`norm_route_
    topk`, one set per (device, router width) and kept, so CUDA graphs capture fixed addresses. The
    layers' launches share it: one runs only after the previous finished (``pdl_start`` first)."""
    key = (device, columns)
    if key not in _WORKSPACES:
        _WORKSPACES[key] = (
            torch.empty(ROUTE_ROWS, columns, dtype=torch.float32, device=device),
            torch.zeros(ROUTE_ROWS, dtype=torch.int32, device=device),
        )
    return _WORKSPACES[key]


def norm_route_topk(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    router: torch.Tensor,
    eps: float,
    k: int,
    norm: bool,
    shared: int,
    normed: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`softmax_topk` of ``rms_norm_zero_centred(x) @ router.T``, the normed rows written into
    ``normed`` (the experts' input), for at most ``ROUTE_ROWS`` rows in one launch: at batch 1 the norm,
    the router GEMM and the selection were three launches of a few microseconds each, reading 1 MB."""
    tokens, hidden = x.shape
    columns = router.shape[0]
    experts = columns - 1
    if not 0 < tokens <= ROUTE_ROWS or x.stride(-1) != 1 or normed.stride(-1) != 1:
        raise ValueError(
            f"norm_route_topk: 1..{ROUTE_ROWS} rows with a contiguous last dim, got {tuple(x.shape)}"
        )
    if (
        router.shape[1] != hidden
        or router.stride(-1) != 1
        or normed.shape[0] < tokens
        or not 0 < k <= experts
    ):
        raise ValueError(f"norm_route_topk: router {tuple(router.shape)} for x {tuple(x.shape)}, top {k}")
    logits, count = _workspace(x.device, columns)
    weights = torch.empty(tokens, k + shared, dtype=x.dtype, device=x.device)
    ids = torch.empty(tokens, k + shared, dtype=torch.int64, device=x.device)
    _norm_route_kernel[(tokens, triton.cdiv(columns, ROUTER_ROWS_PER_PROGRAM))](
        x, norm_weight, router, normed, logits, count, weights, ids, hidden, x.stride(0), router.stride(0),
        normed.stride(0), eps, NUM_EXPERTS=experts, ROWS=ROUTER_ROWS_PER_PROGRAM, CHUNK=ROUTE_CHUNK,
        BLOCK_E=next_pow2(experts), K=k, SHARED=shared, BLOCK_K=max(2, next_pow2(k + shared)), NORM=norm,
        FIX=interp_bf16(x.dtype), num_warps=4, **pdl_launch(x),
    )  # fmt: skip
    return weights, ids


def norm_and_route(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    router: torch.Tensor,
    eps: float,
    k: int,
    norm: bool,
    shared: int,
    normed: torch.Tensor,
    logits: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, ids) of :func:`softmax_topk` for the zero-centred-normed rows ``x`` (the normed rows into
    ``normed``, the logits into ``logits``): one launch for a decode step's few rows on CUDA, else the
    norm, the router GEMM and the selection."""
    if use_triton(x) and 0 < x.shape[0] <= ROUTE_ROWS:
        return norm_route_topk(x, norm_weight, router, eps, k, norm, shared, normed)
    n = rms_norm_zero_centred(x, norm_weight, eps, out=normed)
    return softmax_topk(torch.matmul(n, router.t(), out=logits), k, norm, x.dtype, shared)
