"""DeepSeek-V4's MoE block: every layer routes, either by learned top-k or by a fixed token hash.

Scores are ``sqrt(softplus(x Wgᵀ))`` (float32). A ``moe`` layer picks the top-k experts of
``scores + e_score_correction_bias`` (no groups); a ``hash_moe`` layer picks ``tid2eid[token id]``, a
table in the checkpoint. Either way the weights are the picked *unbiased* scores, normalised to sum 1 and
multiplied by ``routed_scaling_factor``. Experts and the shared expert are SwiGLUs with V4's clamps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pegainfer.errors import CheckpointError
from pegainfer.layers.moe import routed_experts
from pegainfer_deepseek.moe import SwiGLU
from pegainfer_deepseek.params import param
from pegainfer_deepseek.v4_config import DeepseekV4Dims
from pegainfer_deepseek.v4_weights import V4Weights


class V4Router(nn.Module):
    def __init__(self, dims: DeepseekV4Dims, hashed: bool) -> None:
        super().__init__()
        self.dims = dims
        self.hashed = hashed
        e = dims.n_routed_experts
        self.weight = param(e, dims.hidden_size, dtype=torch.float32)
        if hashed:
            # A buffer (integer, never random-initialised by dummy loading), valid until load replaces it.
            spread = torch.arange(dims.vocab_size)[:, None] + torch.arange(dims.num_experts_per_tok)
            self.register_buffer("tid2eid", spread % e)
        else:
            self.e_score_correction_bias = param(e, dtype=torch.float32)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights ``[T, k]`` fp32, expert ids ``[T, k]``) for ``x [T, H]`` and its token ids ``[T]``."""
        scores = F.softplus(F.linear(x.float(), self.weight)).sqrt()
        if self.hashed:
            ids = self.tid2eid[token_ids]
        else:
            ids = (scores + self.e_score_correction_bias).topk(self.dims.num_experts_per_tok, dim=-1).indices
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.dims.routed_scaling_factor, ids

    def load(self, weights: V4Weights, prefix: str) -> None:
        with torch.no_grad():
            self.weight.copy_(weights.get(prefix + "weight", tuple(self.weight.shape), torch.float32))
            if self.hashed:
                table = weights.get(prefix + "tid2eid", tuple(self.tid2eid.shape), torch.int64)
                if (
                    table.numel()
                    and not 0 <= int(table.min()) <= int(table.max()) < self.dims.n_routed_experts
                ):
                    raise CheckpointError(
                        f"tensor '{prefix}tid2eid' names experts outside [0, n_routed_experts)"
                    )
                self.tid2eid.copy_(table)
            else:
                self.e_score_correction_bias.copy_(
                    weights.get(prefix + "bias", (self.dims.n_routed_experts,), torch.float32)
                )


class V4MoE(nn.Module):
    def __init__(self, dims: DeepseekV4Dims, layer_index: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.dims = dims
        e, h, i = dims.n_routed_experts, dims.hidden_size, dims.moe_intermediate_size
        self.gate = V4Router(dims, hashed=dims.mlp_kinds[layer_index] == "hash_moe")
        self.experts_gate_up = param(e, 2 * i, h, dtype=dtype)
        self.experts_down = param(e, h, i, dtype=dtype)
        # transformers sizes the shared expert at moe_intermediate_size whatever n_shared_experts says.
        self.shared_experts = SwiGLU(h, i, dtype, limit=dims.swiglu_limit)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x, token_ids)
        routed = routed_experts(
            x, weights, ids, self.experts_gate_up, self.experts_down, self.dims.swiglu_limit
        )
        return routed + self.shared_experts(x)

    def load(self, weights: V4Weights, prefix: str) -> None:
        """``prefix`` is e.g. ``layers.3.ffn.``."""
        dims, dtype = self.dims, self.experts_down.dtype
        h, i = dims.hidden_size, dims.moe_intermediate_size
        self.gate.load(weights, prefix + "gate.")
        gate_up, down = weights.get_fused_experts(prefix, dims.n_routed_experts, h, i, dtype)
        shared = prefix + "shared_experts."
        with torch.no_grad():
            self.experts_gate_up.copy_(gate_up)
            self.experts_down.copy_(down)
            self.shared_experts.load_gate_up(
                weights.get(shared + "w1.weight", (i, h), dtype),
                weights.get(shared + "w3.weight", (i, h), dtype),
            )
            self.shared_experts.down_proj.copy_(weights.get(shared + "w2.weight", (h, i), dtype))
