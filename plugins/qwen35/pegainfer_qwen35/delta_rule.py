"""Gated DeltaNet math, torch reference: the causal depthwise conv with a rolling window, and the gated
delta rule in its chunked (prefill) and single-step (decode) forms.

The recurrence, per value head with state S in R^{dk x dv} (fp32), for each token t:

    S <- exp(g_t) S;   u_t = beta_t (v_t - S^T k_t);   S <- S + k_t u_t^T;   o_t = S^T q_t

The chunked form computes the same thing a block of C tokens at a time. Inside a block, with gamma the
running sum of g, the updates u satisfy a unit lower-triangular system (the WY/UT transform), solved once
per block; a sequential pass over the blocks then carries S. Both forms take and return the state, so a
prompt split over several prefill chunks (or finished by single steps) gives the state one pass would.

These functions are the oracle for the fused kernels of the GPU path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_SIZE = 64


def l2_normalise(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x * rsqrt(sum(x^2) + eps)`` over the last dim (the form fla and transformers use)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


# ----------------------------------------------------------------------------------------------- conv


def causal_conv_prefill(
    x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv of one sequence's chunk.

    x ``[T, C]`` (pre-conv projections), weight ``[C, K]``, window ``[C, K-1]``: the K-1 inputs before
    this chunk (zeros at the sequence start). Returns the conv output ``[T, C]`` (before the activation)
    and the new window: the last K-1 inputs, which may still include old ones when T < K-1.
    """
    seq = torch.cat([window.to(x.dtype), x.t()], dim=1)  # [C, K-1+T]
    y = F.conv1d(seq.unsqueeze(0), weight.unsqueeze(1), groups=weight.shape[0])[0]  # [C, T]
    return y.t(), seq[:, seq.shape[1] - window.shape[1] :]


def conv_window_after(x: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    """The window ``[C, K-1]`` after the inputs x ``[T, C]`` that follow ``window`` (what
    ``causal_conv_prefill`` returns beside its output, without the conv)."""
    seq = torch.cat([window.to(x.dtype), x.t()], dim=1)
    return seq[:, seq.shape[1] - window.shape[1] :]


def causal_conv_step(
    x: torch.Tensor, weight: torch.Tensor, windows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of B sequences: x ``[B, C]``, windows ``[B, C, K-1]``; returns ``[B, C]`` and the
    shifted windows."""
    seq = torch.cat([windows.to(x.dtype), x.unsqueeze(-1)], dim=-1)  # [B, C, K]
    y = F.conv1d(seq, weight.unsqueeze(1), groups=weight.shape[0])[..., 0]
    return y, seq[..., 1:]


# ----------------------------------------------------------------------------------------- delta rule


def delta_rule_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of B sequences at once (fp32). q, k ``[B, H, dk]``, v ``[B, H, dv]``, g and beta ``[B, H]``,
    state ``[B, H, dk, dv]``. Returns o ``[B, H, dv]`` and the new state."""
    state = state * g.exp()[..., None, None]
    recalled = (k.unsqueeze(-2) @ state).squeeze(-2)  # S^T k
    update = beta.unsqueeze(-1) * (v - recalled)
    state = state + k.unsqueeze(-1) * update.unsqueeze(-2)  # + k u^T
    return (q.unsqueeze(-2) @ state).squeeze(-2), state


def recurrent_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token over one sequence (the definition; tests compare the chunked form with it).
    Shapes as ``chunked_delta_rule``."""
    out = []
    state = state.unsqueeze(0)
    for t in range(q.shape[0]):
        o, state = delta_rule_step(
            q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], state
        )
        out.append(o)
    return torch.cat(out), state[0]


def _blocks(x: torch.Tensor, num_blocks: int, size: int) -> torch.Tensor:
    """``[T, H, ...]`` -> ``[H, num_blocks, size, ...]``, zero-padded after the last token."""
    padded = x.new_zeros(x.shape[1], num_blocks * size, *x.shape[2:])
    padded[:, : x.shape[0]] = x.transpose(0, 1)
    return padded.view(x.shape[1], num_blocks, size, *x.shape[2:])


def chunked_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule over one sequence's T tokens, a block of ``chunk_size`` at a time (fp32).

    q, k ``[T, H, dk]`` (already L2-normalised, q scaled), v ``[T, H, dv]``, g (log decay, <= 0) and beta
    ``[T, H]``, state ``[H, dk, dv]``: the state before the first token. Returns o ``[T, H, dv]`` and the
    state after the last token. Padding tokens (g = 0, beta = 0, k = 0) leave the state unchanged.
    """
    num_tokens = q.shape[0]
    size = chunk_size
    n = -(-num_tokens // size)
    q, k, v = (_blocks(x, n, size) for x in (q, k, v))  # [H, N, C, d]
    g, beta = (_blocks(x, n, size) for x in (g, beta))  # [H, N, C]
    gamma = g.cumsum(-1)  # log of the decay from the block start to each token
    k_beta, v_beta = k * beta.unsqueeze(-1), v * beta.unsqueeze(-1)

    causal = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
    # decay[i, j] = exp(gamma_i - gamma_j) for j <= i, else 0 (masked before the exp: no overflow).
    decay = torch.where(causal, gamma.unsqueeze(-1) - gamma.unsqueeze(-2), float("-inf")).exp()
    # Unit lower-triangular system (I + L) u = beta (v - exp(gamma) S^T k), L strictly below the diagonal.
    system = (k_beta @ k.transpose(-1, -2)) * decay
    system = system.masked_fill(~causal.tril(-1), 0.0) + torch.eye(size, device=q.device)
    fresh = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    reads = torch.linalg.solve_triangular(
        system, k_beta * gamma.exp().unsqueeze(-1), upper=False, unitriangular=True
    )
    scores = (q @ k.transpose(-1, -2)) * decay  # within-block attention, diagonal included
    q_decayed = q * gamma.exp().unsqueeze(-1)
    total = gamma[..., -1:]  # [H, N, 1]: log decay over the whole block
    k_to_end = k * (total - gamma).exp().unsqueeze(-1)

    out = torch.empty_like(v)
    state = state.float()
    for b in range(n):
        updates = fresh[:, b] - reads[:, b] @ state  # [H, C, dv]
        out[:, b] = q_decayed[:, b] @ state + scores[:, b] @ updates
        state = state * total[:, b].exp().unsqueeze(-1) + k_to_end[:, b].transpose(-1, -2) @ updates
    o = out.view(out.shape[0], n * size, -1)[:, :num_tokens].transpose(0, 1)
    return o, state
