"""The forward's pass buffers: one ``[T, width]`` tensor per role, allocated once per forward.

Every layer of a kind writes its stage outputs into the same role buffers (the projections of layer 7 go
where those of layer 3 went), so a step's scratch memory does not grow with depth. The residual stream
lives in one block (``hidden``): each layer adds its mixer's and its FFN's outputs to it in place (inside
the output GEMMs on the CUDA decode path). On CUDA the projections return tensors of their own (the
skinny GEMM's outputs) where the reference path writes the roles. The memory plan reserves ``bytes_per_token`` of every role
times the step's token budget (``transient_specs``) before it sizes the page pool.

Two more roles are no buffers but declared bounds on temporaries (``SCRATCH_ROLES``):
``reference_scratch`` per token, for what the torch reference path creates inside one layer (fp32 norm
copies, the delta rule's block matrices), and ``decode_state_scratch`` per sequence, for the fp32 copies
of the slot states a decode step gathers, updates and scatters back. Fused kernels make them smaller; the
memory plan must still count them for the reference path.

Under tensor parallelism every width is the rank's (``Qwen35Shard``): its heads, its conv channels, its
share of the FFN features; the hidden-size roles stay whole (the row-parallel outputs are all-reduced in
place in ``mixer_out`` / ``mlp_down``), and so does the replicated router.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pegainfer.memory.buffer_specs import TransientSpec, dtype_size
from pegainfer_qwen35.config import FULL, LINEAR, Qwen35Config, Qwen35Shard
from pegainfer_qwen35.delta_rule import CHUNK_SIZE

ROLE_PREFIX = "qwen35."
SCRATCH_ROLES = frozenset({ROLE_PREFIX + "reference_scratch", ROLE_PREFIX + "decode_state_scratch"})


@dataclass(frozen=True)
class Role:
    name: str
    width: int  # elements per token
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        return self.width * dtype_size(self.dtype)


def pass_buffer_roles(
    config: Qwen35Config, dtype: torch.dtype, shard: Qwen35Shard | None = None
) -> list[Role]:
    """The roles a forward allocates, from the rank-local geometry (``shard``; None: the whole model).
    Only the layer kinds present get their roles."""
    s = shard or Qwen35Shard.of(config)
    h = config.hidden_size
    roles = [Role(name, h, dtype) for name in ("hidden", "normed", "mixer_out", "mlp_down")]
    if config.layers_of(FULL):
        q, kv = s.num_heads * config.head_dim, s.num_kv_heads * config.head_dim
        roles += [
            Role("attn_qkv", 2 * q + 2 * kv, dtype),  # per head [query | gate], then k, then v
            Role("attn_q", q, dtype),  # after q_norm and rotary
            Role("attn_k", kv, dtype),  # after k_norm and rotary
            Role("attn_out", q, dtype),  # attention output times sigmoid(gate)
        ]
    if config.layers_of(LINEAR):
        hv = s.linear_num_value_heads
        roles += [
            Role("gdn_proj", s.conv_dim + s.value_dim + 2 * hv, dtype),  # q|k|v, z, b, a
            Role("gdn_conv", s.conv_dim, dtype),  # after the causal conv and SiLU
            Role("gdn_core", s.value_dim, dtype),  # delta-rule output
            Role("gdn_gated", s.value_dim, dtype),  # gated RMSNorm output
        ]
    if config.is_moe:
        # The chosen experts, then the shared expert's pieces (``moe.SparseMoE``).
        k, ie = config.num_experts_per_tok + s.shared_pieces, s.moe_intermediate_size
        roles += [
            Role("moe_router", config.num_experts + 1, dtype),  # the router's logits, the shared gate's
            Role("moe_rows", k * h, dtype),  # each token's row once per chosen expert, grouped by expert
            Role("moe_gate_up", k * 2 * ie, dtype),
            Role("moe_act", k * ie, dtype),
            Role("moe_out", k * h, dtype),
        ]
    if config.has_dense_ffn:
        i = s.intermediate_size
        roles += [Role("mlp_gate_up", 2 * i, dtype), Role("mlp_act", i, dtype)]
    return roles


def reference_scratch_bytes_per_token(config: Qwen35Config, shard: Qwen35Shard | None = None) -> int:
    """A bound on the per-token temporaries alive at once inside one layer of the torch reference path
    (the rank's value heads under tensor parallelism)."""
    f32 = 4
    hv, dk, dv, c = (
        (shard or Qwen35Shard.of(config)).linear_num_value_heads,
        config.linear_key_head_dim,
        config.linear_value_head_dim,
        CHUNK_SIZE,
    )
    # Chunked delta rule: q, k (GVA-expanded, normalised, blocked, decayed), beta*k, solves; v, beta*v,
    # updates, output; the block matrices (pairwise decay, system, scores) of C entries per token.
    gdn = f32 * hv * (8 * dk + 6 * dv + 4 * c) if config.layers_of(LINEAR) else 0
    norms = 3 * f32 * config.hidden_size  # fp32 copy, its square and the scaled result
    router = 2 * f32 * config.num_experts
    return gdn + norms + router


def transient_specs(
    config: Qwen35Config, dtype: torch.dtype, shard: Qwen35Shard | None = None
) -> list[TransientSpec]:
    s = shard or Qwen35Shard.of(config)
    specs = [
        TransientSpec(ROLE_PREFIX + role.name, bytes_per_token=role.bytes_per_token)
        for role in pass_buffer_roles(config, dtype, s)
    ]
    specs.append(
        TransientSpec(
            ROLE_PREFIX + "reference_scratch", bytes_per_token=reference_scratch_bytes_per_token(config, s)
        )
    )
    if config.layers_of(LINEAR):
        # Gathered state, decayed state, the rank-1 update and the new state of one GDN layer, in fp32.
        state = s.linear_num_value_heads * s.linear_key_head_dim * s.linear_value_head_dim
        window = s.conv_dim * config.conv_kernel
        specs.append(
            TransientSpec(ROLE_PREFIX + "decode_state_scratch", bytes_per_seq=4 * 4 * (state + window))
        )
    return specs


class PassBuffers:
    """One forward's buffers, ``[num_tokens, width]`` per role, reachable as attributes (``bufs.normed``)."""

    def __init__(self, roles: list[Role], num_tokens: int, device: torch.device) -> None:
        self.num_tokens = num_tokens
        self.tensors = {
            role.name: torch.empty(num_tokens, role.width, dtype=role.dtype, device=device) for role in roles
        }

    def __getattr__(self, name: str) -> torch.Tensor:
        try:
            return self.__dict__["tensors"][name]
        except KeyError:
            raise AttributeError(f"no pass buffer for role '{name}'") from None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())
