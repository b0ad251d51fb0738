"""Run by ``test_qwen35_kernel_scratch.py`` in a process of its own (fla importable, started without
``TRITON_INTERPRET``, every Triton launch stubbed out): prints, as JSON, the peak bytes each kernel-path
part of a prefill layer allocates at the test's shape, for ``SEGMENTS`` and for ``LONG_SEGMENTS``
(``null`` for fla's where fla-core is not installed). The test imports it for its shape too, so importing
it changes nothing."""

from __future__ import annotations

import json
import sys
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pegainfer.kernels import fused_moe
from pegainfer_qwen35 import gated_deltanet
from pegainfer_qwen35.config import Qwen35Config

DTYPE = torch.bfloat16
SEGMENTS = [(0, 100), (100, 156)]  # two prefill segments (start, length) of 2 and 3 chunks
#: The same two segments longer by whole 64-token chunks (so each ends in a partial chunk of the same
#: length and chunk rounding adds the same to both): the growth between the two is what a token costs,
#: which the per-segment terms of a bound cannot hide.
LONG_SEGMENTS = [(0, 420), (420, 412)]


def tokens(segments: list[tuple[int, int]]) -> int:
    return sum(n for _, n in segments)


TOKENS, LONG_TOKENS = tokens(SEGMENTS), tokens(LONG_SEGMENTS)


def config() -> Qwen35Config:
    return Qwen35Config(
        vocab_size=64, hidden_size=256, num_layers=2, layer_types=("linear_attention", "full_attention"),
        rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=1024, num_heads=4,
        num_kv_heads=2, head_dim=64, rotary_dim=16, rope_theta=1e4, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64, conv_kernel=4,
        num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64, shared_expert_intermediate_size=128,
    )  # fmt: skip


class LiveStorages(TorchDispatchMode):
    """The peak bytes of storages created inside the mode and alive at once (views of one storage and the
    tensors that existed before count nothing)."""

    def __init__(self, existing: list[torch.Tensor]) -> None:
        super().__init__()
        self.known = {t.untyped_storage().data_ptr() for t in existing}
        self.live = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                ptr, size = storage.data_ptr(), storage.nbytes()
                if size and ptr not in self.known:
                    self.known.add(ptr)
                    self.live += size
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._freed, ptr, size)
        return out

    def _freed(self, ptr: int, size: int) -> None:
        self.live -= size
        self.known.discard(ptr)


def stub_launches() -> None:
    """The kernels only write into tensors allocated before they launch: without them, what remains is
    what the part allocates (their outputs are garbage, which nothing here reads)."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    stubs = [JITFunction, Autotuner]
    try:
        from fla.ops.utils.cache import CachedAutotuner

        stubs.append(CachedAutotuner)
    except ImportError:
        pass
    for cls in stubs:
        cls.run = lambda self, *args, **kwargs: None


def fla_peak(segments: list[tuple[int, int]]) -> int | None:
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    c, n = config(), tokens(segments)
    gen = torch.Generator().manual_seed(0)
    conv = torch.randn(n, c.conv_dim, generator=gen).to(DTYPE)
    b, a = (torch.randn(n, c.linear_num_value_heads, generator=gen).to(DTYPE) for _ in range(2))
    a_log, dt_bias = torch.zeros(c.linear_num_value_heads), torch.zeros(c.linear_num_value_heads)
    ssm = torch.zeros(3, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim)
    core = torch.empty(n, c.linear_num_value_heads, c.linear_value_head_dim, dtype=DTYPE)
    rows = gated_deltanet.RecurrentRows(
        segments=segments, segment_slots=torch.tensor([0, 2]), decode_start=n, num_decodes=0,
        decode_slots=torch.zeros(0, dtype=torch.int64),
    )  # fmt: skip
    bounds = rows.cu_seqlens  # built once per forward, before the layers: not the layer's allocation
    with LiveStorages([conv, b, a, a_log, dt_bias, ssm, core, bounds, rows.cu_seqlens_cpu]) as mode:
        assert gated_deltanet.prefill_with_fla(
            conv, b, a, a_log, dt_bias, rows, ssm, c, core, rule=chunk_gated_delta_rule
        )
    return mode.peak


def conv_peak(n: int) -> int:
    c = config()
    x = torch.randn(n, c.conv_dim).to(DTYPE)
    weight = torch.randn(c.conv_dim, c.conv_kernel).to(DTYPE)
    windows = torch.zeros(2, c.conv_dim, c.conv_kernel - 1)
    out, slot = torch.empty_like(x), torch.tensor([1])
    window = windows.index_select(0, slot)[0]
    with LiveStorages([x, weight, windows, out, slot, window]) as mode:
        gated_deltanet._conv_segment(x, weight, window, out, windows, slot)
    return mode.peak


def moe_peak(n: int) -> int:
    """The fused experts' allocations plus the routing's weights and ids (the block's own too)."""
    c = config()
    k, experts = c.num_experts_per_tok + 2, c.num_experts + 2  # the shared expert's two pieces
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(n, c.hidden_size, generator=gen).to(DTYPE)
    gate_up = torch.randn(experts, 2 * c.moe_intermediate_size, c.hidden_size, generator=gen).to(DTYPE)
    down = torch.randn(experts, c.hidden_size, c.moe_intermediate_size, generator=gen).to(DTYPE)
    ids = torch.randint(0, experts, (n, k), generator=gen)
    weights = torch.rand(n, k, generator=gen).to(DTYPE)
    residual = torch.zeros_like(x)
    with LiveStorages([x, gate_up, down, ids, weights, residual]) as mode:
        fused_moe.fused_moe_triton(x, weights, ids, gate_up, down, residual=residual)
    return mode.peak + weights.nbytes + ids.nbytes


if __name__ == "__main__":
    stub_launches()
    json.dump(
        {
            "gdn_fla": [fla_peak(SEGMENTS), fla_peak(LONG_SEGMENTS)],
            "gdn_conv": [conv_peak(TOKENS), conv_peak(LONG_TOKENS)],
            "moe": [moe_peak(TOKENS), moe_peak(LONG_TOKENS)],
        },
        sys.stdout,
    )
