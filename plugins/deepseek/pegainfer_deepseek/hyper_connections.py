"""Manifold-constrained hyper-connections (mHC): DeepSeek-V4's residual of ``n`` parallel streams.

The residual state is ``[T, n, H]`` (the embedding copied n times). Around each sub-block a small
projection of the normed, flattened streams gives three mixes, all in float32:

* ``pre`` [n]: the weights that collapse the streams into the sub-block's input;
* ``post`` [n]: how much of the sub-block's output each stream receives;
* ``comb`` [n, n]: how the old streams mix into the new ones, pushed towards a doubly-stochastic matrix
  by Sinkhorn normalisation so that depth does not blow the residual up.

New stream k is ``post_k · out + Σ_j comb[j, k] · stream_j`` (comb is read transposed). At the end,
``HyperHead`` collapses the streams with its own ``pre`` weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pegainfer_deepseek.params import param
from pegainfer_deepseek.v4_config import DeepseekV4Dims
from pegainfer_deepseek.v4_primitives import unit_rms_norm
from pegainfer_deepseek.v4_weights import V4Weights


class HyperConnection(nn.Module):
    def __init__(self, dims: DeepseekV4Dims) -> None:
        super().__init__()
        n = dims.hc_mult
        self.n, self.iters, self.eps, self.norm_eps = (
            n,
            dims.hc_sinkhorn_iters,
            dims.hc_eps,
            dims.rms_norm_eps,
        )
        self.fn = param((2 + n) * n, n * dims.hidden_size, dtype=torch.float32)
        self.base = param((2 + n) * n, dtype=torch.float32)
        self.scale = param(3, dtype=torch.float32)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(collapsed [T, H], post [T, n], comb [T, n, n])`` for ``streams [T, n, H]``."""
        n = self.n
        mixes = F.linear(unit_rms_norm(streams.flatten(1).float(), self.norm_eps), self.fn)
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w.unflatten(-1, (n, n)) * comb_s + comb_b.view(n, n), dim=-1) + self.eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return collapsed, post, comb

    @staticmethod
    def expand(
        streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
    ) -> torch.Tensor:
        """The new streams after a sub-block that returned ``out [T, H]``."""
        dtype = streams.dtype
        mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
        return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + mixed

    def load(self, weights: V4Weights, prefix: str) -> None:
        """``prefix`` is e.g. ``layers.3.hc_attn_``."""
        with torch.no_grad():
            for name in ("fn", "base", "scale"):
                target = getattr(self, name)
                target.copy_(weights.get(prefix + name, tuple(target.shape), torch.float32))


class HyperHead(nn.Module):
    """Collapses the final streams ``[T, n, H]`` into ``[T, H]`` before the last norm."""

    def __init__(self, dims: DeepseekV4Dims) -> None:
        super().__init__()
        n = dims.hc_mult
        self.eps, self.norm_eps = dims.hc_eps, dims.rms_norm_eps
        self.fn = param(n, n * dims.hidden_size, dtype=torch.float32)
        self.base = param(n, dtype=torch.float32)
        self.scale = param(1, dtype=torch.float32)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        mixes = F.linear(unit_rms_norm(streams.flatten(1).float(), self.norm_eps), self.fn)
        pre = torch.sigmoid(mixes * self.scale + self.base) + self.eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)

    def load(self, weights: V4Weights) -> None:
        with torch.no_grad():
            for name in ("fn", "base", "scale"):
                target = getattr(self, name)
                target.copy_(weights.get("hc_head_" + name, tuple(target.shape), torch.float32))
