"""plan_memory and the buffer specs: transients first, state slots per max_num_seqs, pages from the rest."""

from __future__ import annotations

import pytest
import torch

from pegainfer.errors import ConfigError
from pegainfer.memory.buffer_specs import (
    PagedKVSpec,
    PagedLatentSpec,
    RecurrentStateSpec,
    TransientSpec,
    dtype_size,
)
from pegainfer.memory.memory_plan import MemoryPlan, plan_memory

# 2 layers x (K + V) x 2 heads x 8 dims x 2 bytes = 128 B per token; 16-token pages of 2048 B.
KV_LAYERS = [PagedKVSpec(i, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16) for i in range(2)]
STATE = RecurrentStateSpec(5, shapes=(("conv", (3, 4)), ("ssm", (2, 2, 2))), dtype=torch.float32)  # 80 B
TRANSIENTS = [
    TransientSpec("activations", bytes_per_token=10),
    TransientSpec("sampler", bytes_per_seq=1000),
    TransientSpec("graphs", bytes_fixed=5000),
]


def plan(**overrides: object) -> MemoryPlan:
    args: dict = {
        "budget": 1_000_000,
        "weight_bytes": 100_000,
        "specs": KV_LAYERS,
        "transients": TRANSIENTS,
        "block_size": 16,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 256,
        "max_model_len": 1024,
    }
    args.update(overrides)
    return plan_memory(**args)


# ------------------------------------------------------------------------------------------ specs


def test_dtype_size() -> None:
    """Element sizes used by every byte count."""
    assert dtype_size(torch.float32) == 4 and dtype_size(torch.bfloat16) == 2 and dtype_size(torch.int8) == 1


def test_paged_kv_spec_bytes_and_shape() -> None:
    """Standard attention stores K and V per token."""
    spec = PagedKVSpec(3, num_kv_heads=4, head_dim=64, dtype=torch.float16)
    assert spec.bytes_per_token == 2 * 4 * 64 * 2
    assert spec.page_shape(num_blocks=10, block_size=16) == (2, 10, 16, 4, 64)
    shape = spec.page_shape(10, 16)
    assert torch.empty(shape, dtype=spec.dtype).nbytes == 10 * 16 * spec.bytes_per_token


def test_paged_latent_spec_bytes_and_shape() -> None:
    """MLA stores one latent plus the decoupled rotary key per token."""
    spec = PagedLatentSpec(0, latent_dim=512, rope_dim=64, dtype=torch.bfloat16)
    assert spec.bytes_per_token == (512 + 64) * 2
    assert spec.page_shape(num_blocks=7, block_size=64) == (7, 64, 576)
    assert torch.empty(spec.page_shape(7, 64), dtype=spec.dtype).nbytes == 7 * 64 * spec.bytes_per_token


def test_recurrent_state_spec_bytes() -> None:
    """A recurrent layer's per-request bytes sum every named state."""
    assert STATE.bytes_per_request == (3 * 4 + 2 * 2 * 2) * 4
    assert RecurrentStateSpec(0, shapes=(), dtype=torch.float32).bytes_per_request == 0
    scalar = RecurrentStateSpec(0, shapes=(("s", ()),), dtype=torch.bfloat16)
    assert scalar.bytes_per_request == 2


def test_transient_spec_bytes_for() -> None:
    """Transients scale with the token budget and max_num_seqs, plus a fixed part."""
    t = TransientSpec("x", bytes_fixed=7, bytes_per_token=3, bytes_per_seq=11)
    assert t.bytes_for(max_num_batched_tokens=100, max_num_seqs=4) == 7 + 300 + 44
    assert TransientSpec("empty").bytes_for(100, 4) == 0


# ------------------------------------------------------------------------------------------- plan


def test_plan_exact_arithmetic() -> None:
    """Pages get exactly what weights and worst-case transients leave."""
    p = plan()
    assert p.transients == {"activations": 2560, "sampler": 8000, "graphs": 5000}
    assert p.transient_bytes == 15_560
    assert p.page_bytes == 16 * 128
    assert p.num_blocks == (1_000_000 - 100_000 - 15_560) // 2048 == 431
    assert p.kv_bytes == 431 * 2048
    assert p.num_state_slots == 0 and p.state_bytes == 0
    assert p.block_size == 16 and p.budget == 1_000_000 and p.weight_bytes == 100_000
    assert p.weight_bytes + p.transient_bytes + p.kv_bytes <= p.budget


def test_transients_are_reserved_before_pages() -> None:
    """A larger transient leaves exactly that many fewer bytes for pages."""
    base = plan()
    bigger = plan(transients=[*TRANSIENTS, TransientSpec("prefill_scratch", bytes_fixed=2048 * 10)])
    assert bigger.num_blocks == base.num_blocks - 10
    # Transients scale with the scheduler limits too.
    more_tokens = plan(max_num_batched_tokens=256 + 2048)
    assert more_tokens.transients["activations"] == 10 * (256 + 2048)
    assert more_tokens.num_blocks == (1_000_000 - 100_000 - 15_560 - 20_480) // 2048
    more_seqs = plan(max_num_seqs=16)
    assert more_seqs.transients["sampler"] == 16_000
    assert more_seqs.num_blocks == (1_000_000 - 100_000 - 23_560) // 2048


def test_state_slots_counted_per_max_num_seqs() -> None:
    """Every admitted request needs a state slot: max_num_seqs slots are reserved before pages."""
    p = plan(specs=[*KV_LAYERS, STATE, RecurrentStateSpec(6, (("h", (5,)),), torch.float16)])
    per_slot = 80 + 10
    assert p.num_state_slots == 8 and p.state_bytes_per_slot == per_slot
    assert p.state_bytes == 8 * per_slot
    assert p.num_blocks == (1_000_000 - 100_000 - 15_560 - 8 * per_slot) // 2048
    assert plan(specs=[*KV_LAYERS, STATE], max_num_seqs=3).num_state_slots == 3


def test_drafting_reserves_roll_back_snapshots_before_prefix_cachings() -> None:
    """Speculative decoding of k drafts keeps k snapshots a state slot, first in the pool; prefix caching's
    snapshots follow, sized as without drafting; a model without state gets none of either kind."""
    specs = [*KV_LAYERS, STATE]
    cached = plan(specs=specs, prefix_caching=True, num_state_snapshots=5)
    both = plan(specs=specs, prefix_caching=True, num_state_snapshots=5, draft_snapshots_per_seq=3)
    assert both.draft_snapshots_per_slot == 3 and both.num_cache_snapshots == cached.num_cache_snapshots == 5
    assert both.num_snapshot_slots == 8 * 3 + 5
    assert both.num_blocks == (1_000_000 - 100_000 - 15_560 - 8 * 80 - 29 * 80) // 2048
    drafting = plan(specs=specs, draft_snapshots_per_seq=2)
    assert drafting.num_snapshot_slots == 16 and drafting.num_cache_snapshots == 0
    assert plan(draft_snapshots_per_seq=2).num_snapshot_slots == 0


def test_state_only_model_has_no_pages() -> None:
    """Without a paged layer there are no pages, and max_model_len does not constrain the plan."""
    p = plan(specs=[STATE], max_model_len=1 << 20)
    assert p.num_blocks == 0 and p.page_bytes == 0 and p.num_state_slots == 8


def test_latent_and_kv_layers_share_a_page() -> None:
    """Every paged layer uses the same page ids: the page size is the sum over paged layers."""
    latent = PagedLatentSpec(9, latent_dim=6, rope_dim=2, dtype=torch.float32)
    p = plan(specs=[*KV_LAYERS, latent])
    assert p.page_bytes == 16 * (128 + 32)


def test_num_blocks_override_respected() -> None:
    """An explicit page count wins over the computed one, whichever way."""
    assert plan(num_blocks_override=64).num_blocks == 64
    assert plan(num_blocks_override=5000).num_blocks == 5000
    # With an override, a budget smaller than the weights is not an error (there is nothing to size).
    assert plan(budget=1, num_blocks_override=64).num_blocks == 64


def test_one_max_model_len_request_must_fit() -> None:
    """The pool must hold one request of max_model_len tokens; exactly enough is fine."""
    assert plan(max_model_len=431 * 16).num_blocks == 431
    with pytest.raises(ConfigError, match="max_model_len=6897"):
        plan(max_model_len=431 * 16 + 1)
    with pytest.raises(ConfigError, match="fewer than one request"):
        plan(num_blocks_override=3, max_model_len=64)
    assert plan(num_blocks_override=4, max_model_len=64).num_blocks == 4


def test_weights_and_transients_over_budget() -> None:
    """Weights plus transients beyond the budget are a ConfigError naming both."""
    with pytest.raises(ConfigError, match="exceed the memory budget"):
        plan(specs=[STATE], weight_bytes=990_000)
    with pytest.raises(ConfigError):
        plan(weight_bytes=990_000)
    with pytest.raises(ConfigError):
        plan(budget=10_000, weight_bytes=0, transients=[TransientSpec("huge", bytes_fixed=20_000)])


def test_weights_and_transients_over_budget_names_the_cause_with_paged_layers() -> None:
    """The error for an over-full budget names weights and transients, whatever the model's layers."""
    with pytest.raises(ConfigError, match="exceed the memory budget"):
        plan(weight_bytes=990_000)


def test_describe_mentions_every_part() -> None:
    """The log line names every transient role and the page pool."""
    p = plan(specs=[*KV_LAYERS, STATE])
    text = p.describe()
    for role in ("activations", "sampler", "graphs"):
        assert role in text
    assert f"pages {p.num_blocks} x 2.0 KiB" in text
    assert "state slots 8" in text
    assert MemoryPlan(budget=0, weight_bytes=0).describe().startswith("memory plan")
