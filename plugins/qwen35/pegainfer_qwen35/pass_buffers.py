"""The forward's pass buffers: one ``[T, width]`` tensor per role, allocated once per forward.

Every layer of a kind writes its stage outputs into the same role buffers (the projections of layer 7 go
where those of layer 3 went), so a step's scratch memory does not grow with depth. The residual stream
lives in one block (``hidden``): each layer adds its mixer's and its FFN's outputs to it in place (inside
the output GEMMs on the CUDA decode path). On CUDA the projections return tensors of their own (the
skinny GEMM's outputs) where the reference path writes the roles. The memory plan reserves ``bytes_per_token`` of every role
times the step's token budget (``transient_specs``) before it sizes the page pool.

The other specs are no buffers but declared bounds on temporaries (``SCRATCH_ROLES``), by path:
- the torch reference path (the CPU, or CUDA without the kernels): ``reference_scratch`` per token, for
  what it creates inside one layer (fp32 norm copies, the delta rule's block matrices), and
  ``decode_state_scratch`` per sequence, for the fp32 copies of the slot states a decode step gathers,
  updates and scatters back;
- the CUDA kernel path (``kernels=True``: Triton kernels, fused MoE, fla's chunked prefill): decode rows
  update their slots in place, and ``kernel_scratch`` bounds what one prefill layer allocates of its own
  (:func:`kernel_scratch`); the MoE's reference-only roles (the gathered rows and the experts' outputs) are
  not allocated, since the fused kernels keep their own;
- both: the attention backend's ``attention_scratch`` (``pegainfer.ops.attention_scratch``).
On the GPU the plan's reserve against what a prefill allocates is measured by ``test_qwen35_gpu.py``.

Under tensor parallelism every width is the rank's (``Qwen35Shard``): its heads, its conv channels, its
share of the FFN features; the hidden-size roles stay whole (the row-parallel outputs are all-reduced in
place in ``mixer_out`` / ``mlp_down``), and so does the replicated router.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pegainfer.memory.buffer_specs import TransientSpec, dtype_size
from pegainfer.ops import attention_scratch
from pegainfer_qwen35.config import FULL, LINEAR, Qwen35Config, Qwen35Shard
from pegainfer_qwen35.delta_rule import CHUNK_SIZE

ROLE_PREFIX = "qwen35."
SCRATCH_ROLES = frozenset(
    {
        ROLE_PREFIX + "reference_scratch",
        ROLE_PREFIX + "decode_state_scratch",
        ROLE_PREFIX + "kernel_scratch",
        "attention_scratch",
    }
)
#: What the first long prefill of a process allocates once beyond the steady state: Triton's autotuner
#: (fla's kernels tune on first use) benchmarks each candidate over a 256 MiB buffer it allocates to flush
#: the L2, and the first GEMMs take cuBLAS's workspace. Measured on an H200 (test_qwen35_gpu.py, 2026-12-07):
#: 265.7 MiB for a cold 256-token prefill whose warm forwards allocate 8-19 MiB.
FIRST_PREFILL_BYTES = 288 * 2**20
#: fla's chunk length (``chunk_gated_delta_rule``'s default, which ``prefill_with_fla`` keeps).
FLA_CHUNK = 64


@dataclass(frozen=True)
class Role:
    name: str
    width: int  # elements per token
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        return self.width * dtype_size(self.dtype)


def pass_buffer_roles(
    config: Qwen35Config, dtype: torch.dtype, shard: Qwen35Shard | None = None, *, kernels: bool = False
) -> list[Role]:
    """The roles a forward allocates, from the rank-local geometry (``shard``; None: the whole model).
    Only the layer kinds present get their roles; ``kernels`` (the CUDA kernel path) drops the MoE roles
    only the reference path writes."""
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
        roles.append(
            Role("moe_router", config.num_experts + 1, dtype)
        )  # the router's logits, the shared gate's
        if not kernels:
            # The chosen experts, then the shared expert's pieces (``moe.SparseMoE``).
            k, ie = config.num_experts_per_tok + s.shared_pieces, s.moe_intermediate_size
            roles += [
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


def kernel_scratch_parts(
    config: Qwen35Config, dtype: torch.dtype, shard: Qwen35Shard | None = None
) -> dict[str, tuple[int, int]]:
    """(bytes per token, bytes per prefill segment) that each part of a prefill layer on the CUDA kernel
    path allocates of its own, one part at a time (layers and their parts run one after another):

    - ``gdn_conv``: the torch conv of a long segment (its input with the window, the conv output, the SiLU;
      per segment the window cast both ways);
    - ``gdn_fla``: fla's chunked delta rule over every segment: contiguous and L2-normalised q/k, v, w, u,
      the new values and the output, the solved 64-wide chunk matrices, three fp32 values a value head
      (gate, beta and one more on CUDA), the chunk states (one per 64 tokens, plus one per segment), and
      per segment the gathered and final fp32 state;
    - ``moe``: the fused kernels' activation and output rows per choice, their expert-sorted indices, the
      routing's weights and ids (and their flat copy), the block's output where an all-reduce follows;
    - ``attention``: the q/k norms' and rotary's outputs (and its cos/sin rows), the attention output and
      the gate's sigmoid.
    ``test_qwen35_kernel_scratch.py`` measures the first three's allocations against them."""
    s = shard or Qwen35Shard.of(config)
    d, f32, i64 = dtype_size(dtype), 4, 8
    parts: dict[str, tuple[int, int]] = {}
    if config.layers_of(LINEAR):
        hk, hv = s.linear_num_key_heads, s.linear_num_value_heads
        dk, dv, c = config.linear_key_head_dim, config.linear_value_head_dim, FLA_CHUNK
        qkv = d * (2 * hk * dk + hv * dv) + 2 * d * hk * dk + 2 * f32 * hk
        # w, u, v_new, o; A; gate, beta, and a third [T, Hv] fp32 that fla allocates on CUDA beyond its
        # CPU fallback (an H100, fla 0.6.0: 128 B a token at the 9B shape, bench/qwen35_transients.py).
        wy = d * hv * (dk + 3 * dv) + d * hv * c + 3 * f32 * hv
        states = d * hv * dk * dv
        window = s.conv_dim * (config.conv_kernel - 1)
        parts["gdn_conv"] = (3 * d * s.conv_dim, (2 * d + f32) * window)
        chunks = -(-(states + 8 * i64) // c)  # a chunk's state and fla's index arrays (a few int64 a chunk)
        parts["gdn_fla"] = (qkv + wy + chunks, states + 2 * f32 * hv * dk * dv)
    if config.is_moe:
        k, h = config.num_experts_per_tok + s.shared_pieces, config.hidden_size
        parts["moe"] = (d * k * (s.moe_intermediate_size + h) + 2 * i64 * k + 2 * d * k + d * h, 0)
    if config.layers_of(FULL):
        q, kv = s.num_heads * config.head_dim, s.num_kv_heads * config.head_dim
        parts["attention"] = (d * (4 * q + 2 * kv) + 2 * f32 * config.rotary_dim, 0)
    return parts


def kernel_scratch(
    config: Qwen35Config, dtype: torch.dtype, shard: Qwen35Shard | None = None
) -> TransientSpec:
    """A bound on what one layer of a prefill forward allocates of its own on the CUDA kernel path: the
    largest of :func:`kernel_scratch_parts` per token and per segment, and ``FIRST_PREFILL_BYTES`` (fla's
    autotuning at the first long prefill)."""
    parts = kernel_scratch_parts(config, dtype, shard).values()
    return TransientSpec(
        ROLE_PREFIX + "kernel_scratch",
        bytes_fixed=FIRST_PREFILL_BYTES if config.layers_of(LINEAR) else 0,
        bytes_per_token=max((t for t, _ in parts), default=0),
        bytes_per_seq=max((n for _, n in parts), default=0),
    )


def transient_specs(
    config: Qwen35Config,
    dtype: torch.dtype,
    shard: Qwen35Shard | None = None,
    *,
    device: torch.device | None = None,
    max_model_len: int = 0,
    kernels: bool = False,
) -> list[TransientSpec]:
    """What a forward may hold beyond the weights, states and pages: the pass buffers, then the path's
    scratch (the kernel path's with ``kernels``), then the attention backend's on ``device`` (for contexts
    up to ``max_model_len``) where the model has full-attention layers."""
    s = shard or Qwen35Shard.of(config)
    specs = [
        TransientSpec(ROLE_PREFIX + role.name, bytes_per_token=role.bytes_per_token)
        for role in pass_buffer_roles(config, dtype, s, kernels=kernels)
    ]
    if kernels:
        specs.append(kernel_scratch(config, dtype, s))
    else:
        specs.append(
            TransientSpec(
                ROLE_PREFIX + "reference_scratch",
                bytes_per_token=reference_scratch_bytes_per_token(config, s),
            )
        )
        if config.layers_of(LINEAR):
            # Gathered state, decayed state, the rank-1 update and the new state of one GDN layer, in fp32.
            state = s.linear_num_value_heads * s.linear_key_head_dim * s.linear_value_head_dim
            window = s.conv_dim * config.conv_kernel
            specs.append(
                TransientSpec(ROLE_PREFIX + "decode_state_scratch", bytes_per_seq=4 * 4 * (state + window))
            )
    if device is not None and config.layers_of(FULL):
        specs.append(
            attention_scratch(s.num_heads, s.num_kv_heads, config.head_dim, max_model_len, dtype, device)
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
