"""DeepSeek-V4's pieces one at a time: config parsing, the compressor (against transformers' modules and
across chunk splits), hyper-connections, and where compressed entries live in the pages."""

from __future__ import annotations

import random

import pytest
import torch

from pegainfer.errors import CheckpointError
from pegainfer.memory.buffer_specs import PagedCompressedSpec
from pegainfer_deepseek.hyper_connections import HyperConnection, HyperHead
from pegainfer_deepseek.tiny_v4 import deepseek_v4_config
from pegainfer_deepseek.v4_compressor import Compressor
from pegainfer_deepseek.v4_config import CSA, HCA, SLIDING, DeepseekV4Dims
from pegainfer_deepseek.v4_primitives import TrailingRope
from pegainfer_deepseek.v4_sequences import SequenceRows, entry_slots

transformers_v4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")


def _dims(**overrides) -> DeepseekV4Dims:
    return DeepseekV4Dims.from_hf_config(deepseek_v4_config(1024, **overrides))


def _hf_config(**overrides):
    return transformers_v4.DeepseekV4Config(**deepseek_v4_config(1024, **overrides))


# ------------------------------------------------------------------------------------------------ config


def test_config_reads_layer_kinds_ratios_and_ropes():
    dims = _dims()
    assert dims.layer_kinds == (SLIDING, CSA, HCA, CSA)
    assert [dims.ratio(i) for i in range(4)] == [0, 2, 8, 2]
    assert dims.mlp_kinds == ("hash_moe", "hash_moe", "moe", "moe")
    assert dims.rope_dim == 16
    assert dims.main_rope.yarn is None and dims.main_rope.theta == 20000.0
    assert dims.compress_rope.theta == 80000.0 and dims.compress_rope.yarn.cos_sin_factor() == 1.0


def test_legacy_spellings_mean_what_transformers_reads():
    """DeepSeek's own config keys (per-layer ``compress_ratios``, ``num_hash_layers``,
    ``qk_rope_head_dim``, flat yarn ``rope_scaling``) parse to the model transformers builds."""
    legacy = deepseek_v4_config(1024, compress_ratios=[128, 4, 0], num_hidden_layers=3, num_hash_layers=1)
    for key in (
        "layer_types",
        "mlp_layer_types",
        "compress_rates",
        "rope_parameters",
        "partial_rotary_factor",
    ):
        legacy.pop(key)
    legacy.update(
        qk_rope_head_dim=8,
        compress_rope_theta=40000.0,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
    )
    dims = DeepseekV4Dims.from_hf_config(legacy)
    hf = transformers_v4.DeepseekV4Config(**legacy)
    assert list(dims.layer_kinds) == hf.layer_types == [HCA, CSA, SLIDING]
    assert list(dims.mlp_kinds) == hf.mlp_layer_types == ["hash_moe", "moe", "moe"]
    assert dims.rope_dim == hf.qk_rope_head_dim == 8
    rotary = transformers_v4.DeepseekV4RotaryEmbedding(hf)
    ours = TrailingRope(dims.compress_rope, dims.rope_dim)
    positions = torch.arange(64)
    cos, sin = rotary(torch.zeros(1), positions[None], layer_type="compress")
    x = torch.randn(64, 1, 16)
    expected = transformers_v4.apply_rotary_pos_emb(x.transpose(0, 1)[None], cos, sin)[0].transpose(0, 1)
    torch.testing.assert_close(ours(x, positions), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"scoring_func": "sigmoid"}, "scoring_func"),
        ({"layer_types": ["sliding_attention"] * 3}, "layer_types"),
        ({"mlp_layer_types": ["moe", "dense", "moe", "moe"]}, "mlp_layer_types"),
        ({"o_groups": 3}, "o_groups"),
        ({"num_key_value_heads": 4}, "one shared KV head"),
    ],
)
def test_unsupported_settings_are_refused(override, message):
    with pytest.raises(CheckpointError, match=message):
        _dims(**override)


# -------------------------------------------------------------------------------------------- compressor


def _compressor(kind: str, dims: DeepseekV4Dims, gen: torch.Generator) -> Compressor:
    ratio, overlapping = dims.compress_rates[kind], kind == CSA
    compressor = Compressor(
        dims.hidden_size,
        dims.head_dim,
        ratio,
        overlapping=overlapping,
        eps=dims.rms_norm_eps,
        dtype=torch.float32,
    )
    with torch.no_grad():
        for tensor in compressor.parameters():
            tensor.copy_(torch.randn(tensor.shape, generator=gen) * 0.3)
    return compressor


def _run(compressor: Compressor, x: torch.Tensor, cuts: list[int], block_size: int = 4) -> torch.Tensor:
    """Every compressed entry of ``x``'s tokens, fed in chunks ending at ``cuts``; ``[entries, dim]``."""
    pages = -(-x.shape[0] // block_size)
    spec = PagedCompressedSpec(0, compressor.entry_dim, compressor.ratio, torch.float32)
    cache = torch.zeros(spec.page_shape(pages, block_size))
    ring = torch.zeros(1, *compressor.ring_shape)
    table = torch.randperm(pages)  # pages out of order, as a pool hands them out
    dims = _dims()
    rope = TrailingRope(dims.compress_rope, dims.rope_dim)
    start = 0
    for end in [*cuts, x.shape[0]]:
        seq = SequenceRows(0, end - start, start, 0, table)
        compressor(x[start:end], [seq], ring, cache, block_size, rope)
        start = end
    entries = torch.arange(x.shape[0] // compressor.ratio)
    return cache.flatten(0, 1)[entry_slots(table, entries, compressor.ratio, block_size, cache.shape[1])]


@pytest.mark.parametrize("kind", [CSA, HCA])
def test_compressor_equals_transformers_one_shot(kind):
    gen = torch.Generator().manual_seed(0)
    dims = _dims()
    ours = _compressor(kind, dims, gen)
    reference = transformers_v4.COMPRESSOR_CLASSES[kind](_hf_config())
    with torch.no_grad():
        reference.kv_proj.weight.copy_(ours.kv_proj)
        reference.gate_proj.weight.copy_(ours.gate_proj)
        reference.position_bias.copy_(ours.position_bias)
        reference.kv_norm.weight.copy_(ours.kv_norm)
    x = torch.randn(37, dims.hidden_size, generator=gen)
    if kind == CSA:  # the CSA module also runs its indexer; only its compressed entries are compared here
        del reference.indexer
        reference.indexer = lambda *args: torch.zeros(1, 37, 1, dtype=torch.long)
    with torch.no_grad():
        expected, _ = reference(x[None], None, torch.arange(37)[None], None, 0)
    torch.testing.assert_close(_run(ours, x, []), expected[0, 0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", [CSA, HCA])
def test_compressor_carries_state_across_any_chunk_split(kind):
    """Chunks cut anywhere (inside windows, one token at a time, across pages) close the same entries as
    one pass over the prompt: the state ring carries the open window (and CSA's previous one)."""
    gen = torch.Generator().manual_seed(1)
    dims = _dims()
    compressor = _compressor(kind, dims, gen)
    x = torch.randn(45, dims.hidden_size, generator=gen)
    whole = _run(compressor, x, [])
    rng = random.Random(kind)
    for _ in range(4):
        cuts = sorted(rng.sample(range(1, 45), rng.randrange(1, 12)))
        torch.testing.assert_close(_run(compressor, x, cuts), whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(_run(compressor, x, list(range(1, 45))), whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("ratio", "block_size"), [(4, 16), (8, 4), (4, 4), (6, 16), (128, 16)])
def test_entry_slots_are_distinct_and_inside_the_request_pages(ratio, block_size):
    spec = PagedCompressedSpec(0, 8, ratio, torch.float32)
    rows = spec.rows_per_page(block_size)
    tokens = 1000
    pages = -(-tokens // block_size)
    table = torch.arange(pages) * 3 + 1  # a request's pages among others'
    slots = entry_slots(table, torch.arange(tokens // ratio), ratio, block_size, rows)
    assert len(set(slots.tolist())) == len(slots)
    assert set((slots // rows).tolist()) <= set(table.tolist())
    assert spec.page_bytes(block_size) == rows * 8 * 4


# -------------------------------------------------------------------------------------- hyper-connections


@pytest.mark.parametrize("converged", [False, True], ids=["tiny-config", "converged"])
def test_hyper_connection_and_head_equal_transformers(converged):
    """With the tiny config's few Sinkhorn iterations and large epsilon, and with the published 20 and 1e-6,
    where ``comb`` converges."""
    gen = torch.Generator().manual_seed(2)
    options = {"hc_sinkhorn_iters": 20, "hc_eps": 1e-6} if converged else {}
    dims, config = _dims(**options), _hf_config(**options)
    streams = torch.randn(7, dims.hc_mult, dims.hidden_size, generator=gen)
    out = torch.randn(7, dims.hidden_size, generator=gen)
    ours, reference = HyperConnection(dims), transformers_v4.DeepseekV4HyperConnection(config)
    head, reference_head = HyperHead(dims), transformers_v4.DeepseekV4HyperHead(config)
    with torch.no_grad():
        for name in ("fn", "base", "scale"):
            value = torch.randn(getattr(ours, name).shape, generator=gen) * 0.3
            getattr(ours, name).copy_(value)
            getattr(reference, name).copy_(value)
            value = torch.randn(getattr(head, name).shape, generator=gen) * 0.3
            getattr(head, name).copy_(value)
            getattr(reference_head, "hc_" + name).copy_(value)
        collapsed, post, comb = ours(streams)
        ref_post, ref_comb, ref_collapsed = reference(streams[None])
        torch.testing.assert_close(collapsed, ref_collapsed[0])
        torch.testing.assert_close(post, ref_post[0])
        torch.testing.assert_close(comb, ref_comb[0])
        # comb is (close to, once converged) doubly stochastic, and read transposed:
        # new_k = Σ_j comb[j, k] stream_j.
        if converged:
            torch.testing.assert_close(comb.sum(dim=-2), torch.ones(7, dims.hc_mult), rtol=1e-4, atol=1e-4)
        mixed = HyperConnection.expand(streams, out, post, comb)
        expected = post[..., None] * out[:, None] + torch.einsum("tjk,tjh->tkh", comb, streams)
        torch.testing.assert_close(mixed, expected)
        torch.testing.assert_close(head(streams), reference_head(streams[None])[0])
