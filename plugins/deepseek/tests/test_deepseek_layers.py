"""The DeepSeek building blocks one at a time: config parsing, YaRN rope, the router, MLA's two forms."""

from __future__ import annotations

import math

import pytest
import torch

from pegainfer.errors import CheckpointError
from pegainfer.layers.attention import AttentionMetadata, PrefillSegment
from pegainfer.layers.rotary_yarn import PairedRotaryEmbedding, default_inv_freq, yarn_inv_freq
from pegainfer.model.model_api import ForwardBatch
from pegainfer.plugins.tiny_checkpoints import to_legacy_layout, to_new_layout
from pegainfer_deepseek.config import DeepseekV3Dims
from pegainfer_deepseek.mla import MLAttention
from pegainfer_deepseek.model import build_rotary
from pegainfer_deepseek.moe import GroupLimitedRouter
from pegainfer_deepseek.tiny import deepseek_v3_config


def _hf_config(**overrides):
    from transformers import DeepseekV3Config

    cfg = to_new_layout(deepseek_v3_config(1024, **overrides))
    return DeepseekV3Config(**cfg)


def _dims(**overrides) -> DeepseekV3Dims:
    return DeepseekV3Dims.from_hf_config(to_new_layout(deepseek_v3_config(1024, **overrides)))


# ------------------------------------------------------------------------------------------------ config


def test_legacy_and_new_layouts_parse_to_the_same_model():
    cfg = deepseek_v3_config(1024)
    cfg["dtype"] = "float32"
    legacy, new = to_legacy_layout(cfg), to_new_layout(cfg)
    assert legacy["rope_scaling"]["type"] == "yarn" and "rope_parameters" not in legacy
    assert DeepseekV3Dims.from_hf_config(legacy) == DeepseekV3Dims.from_hf_config(new)


def test_rope_type_spelled_either_way():
    cfg = to_new_layout(deepseek_v3_config(1024))
    by_type = DeepseekV3Dims.from_hf_config(cfg).rope
    cfg["rope_parameters"]["rope_type"] = cfg["rope_parameters"].pop("type")
    assert DeepseekV3Dims.from_hf_config(cfg).rope == by_type
    assert by_type.rope_type == "yarn" and by_type.yarn.factor == 8.0


def test_derived_head_dim_is_not_the_attention_head_size():
    # transformers saves head_dim = qk_rope_head_dim; the query/key head is nope + rope.
    dims = _dims(head_dim=16)
    assert dims.qk_head_dim == 32 and dims.v_head_dim == 24


@pytest.mark.parametrize(
    "override, message",
    [
        ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
        ({"topk_method": "greedy"}, "topk_method='greedy'"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope type 'linear'"),
        ({"n_routed_experts": 15}, "equal groups"),
        ({"num_experts_per_tok": 9}, "exceeds the experts"),
        ({"quantization_config": {"quant_method": "awq"}}, "is not supported"),
        ({"kv_lora_rank": None}, "lacks 'kv_lora_rank'"),
    ],
)
def test_unsupported_settings_are_refused_by_name(override, message):
    with pytest.raises(CheckpointError, match=message):
        _dims(**override)


# -------------------------------------------------------------------------------------------------- rope

YARN_CASES = [
    {
        "type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 256,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    {
        "type": "yarn",
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    {
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 512,
        "beta_fast": 16,
        "beta_slow": 2,
        "mscale": 1.0,
        "mscale_all_dim": 0.8,
    },
    {"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 128},
    {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 256, "truncate": False},
]


@pytest.mark.parametrize("scaling", YARN_CASES)
def test_yarn_frequencies_and_scales_match_transformers(scaling):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    hf_config = _hf_config(rope_scaling=scaling, qk_rope_head_dim=64)
    hf_inv_freq, hf_attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config)
    dims = _dims(rope_scaling=scaling, qk_rope_head_dim=64)
    torch.testing.assert_close(
        yarn_inv_freq(64, dims.rope.theta, dims.rope.yarn), hf_inv_freq, rtol=1e-6, atol=0
    )
    assert math.isclose(dims.rope.yarn.cos_sin_factor(), hf_attention_factor, rel_tol=1e-12)
    hf_config._attn_implementation = "eager"
    assert math.isclose(dims.softmax_scale, DeepseekV3Attention(hf_config, 0).scaling, rel_tol=1e-12)


def test_deepseek_v3_softmax_scale():
    # V3: factor 40, mscale_all_dim 1 -> (192)^-0.5 * (0.1 ln 40 + 1)^2, about 1.874 / sqrt(192).
    dims = _dims(rope_scaling=YARN_CASES[1], qk_nope_head_dim=128, qk_rope_head_dim=64)
    assert math.isclose(dims.softmax_scale * math.sqrt(192), (0.1 * math.log(40) + 1) ** 2)


@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "half-split"])
def test_rope_pairing_matches_transformers(interleaved):
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    hf_config = _hf_config(rope_interleave=interleaved)
    dims = _dims(rope_interleave=interleaved)
    ours = build_rotary(dims, 64)
    positions = torch.tensor([0, 3, 17, 63])
    q, k = torch.randn(4, 5, 16), torch.randn(4, 1, 16)
    cos, sin = hf.DeepseekV3RotaryEmbedding(hf_config)(q, positions[None])
    # transformers rotates [batch, heads, seq, d]; ours [seq, heads, d].
    apply = hf.apply_rotary_pos_emb_interleave if interleaved else hf.apply_rotary_pos_emb
    hq, hk = apply(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    hq, hk = hq[0].transpose(0, 1), hk[0].transpose(0, 1)
    oq, ok = ours(positions, q, k)
    if interleaved:  # transformers writes the rotated pairs de-interleaved: [evens | odds]
        oq, ok = torch.cat([oq[..., 0::2], oq[..., 1::2]], -1), torch.cat([ok[..., 0::2], ok[..., 1::2]], -1)
    torch.testing.assert_close(oq, hq, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ok, hk, rtol=1e-6, atol=1e-6)


def test_rope_is_relative_in_either_pairing():
    rope = PairedRotaryEmbedding(default_inv_freq(16, 10000.0), 64)
    q, k = torch.randn(1, 1, 16), torch.randn(1, 1, 16)
    a = (rope(torch.tensor([9]), q, k)[0] * rope(torch.tensor([4]), q, k)[1]).sum()
    b = (rope(torch.tensor([30]), q, k)[0] * rope(torch.tensor([25]), q, k)[1]).sum()
    torch.testing.assert_close(a, b)


# ------------------------------------------------------------------------------------------------ router


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"norm_topk_prob": False},
        {"n_group": 8, "topk_group": 3, "num_experts_per_tok": 5},
        {"n_group": 1, "topk_group": 1},
    ],
    ids=["v3-like", "unnormalised", "8-groups", "one-group"],
)
def test_router_matches_transformers(overrides):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    torch.manual_seed(0)
    dims = _dims(**overrides)
    ours = GroupLimitedRouter(dims)
    ref = DeepseekV3TopkRouter(_hf_config(**overrides))
    with torch.no_grad():
        ours.weight.copy_(torch.randn_like(ours.weight) * 0.2)
        ours.e_score_correction_bias.copy_(0.2 * torch.randn(dims.n_routed_experts))
        ref.weight.copy_(ours.weight)
        ref.e_score_correction_bias.copy_(ours.e_score_correction_bias)
    x = torch.randn(200, dims.hidden_size)
    weights, ids = ours(x)
    _, ref_weights, ref_ids = ref(x)
    order, ref_order = ids.argsort(-1), ref_ids.argsort(-1)
    assert torch.equal(ids.gather(1, order), ref_ids.gather(1, ref_order))
    torch.testing.assert_close(weights.gather(1, order), ref_weights.gather(1, ref_order))


def test_routing_bias_selects_but_does_not_weigh():
    torch.manual_seed(1)
    dims = _dims(norm_topk_prob=False, routed_scaling_factor=1.0)
    router = GroupLimitedRouter(dims)
    with torch.no_grad():
        router.weight.copy_(torch.randn_like(router.weight) * 0.2)
        router.e_score_correction_bias.copy_(torch.randn(dims.n_routed_experts))
    x = torch.randn(64, dims.hidden_size)
    weights, ids = router(x)
    scores = torch.sigmoid(x @ router.weight.T)
    torch.testing.assert_close(weights, scores.gather(1, ids))  # unbiased scores
    unbiased_top = scores.topk(dims.num_experts_per_tok, -1).indices.sort(-1).values
    assert not torch.equal(ids.sort(-1).values, unbiased_top)  # ... yet the bias changed the choice
    per_group = dims.n_routed_experts // dims.n_group
    assert all(len(set(groups.tolist())) <= dims.topk_group for groups in ids // per_group)


# --------------------------------------------------------------------------------------------------- MLA


def test_absorbed_decode_equals_expanded_attention():
    """The same query over the same cached latents, once as a decode row (absorbed) and once as the last
    token of a prefill segment (expanded per head)."""
    torch.manual_seed(2)
    dims = _dims()
    mla = MLAttention(dims, torch.float32)
    for p in mla.parameters():
        p.data.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
    rotary = build_rotary(dims, 64)
    block_size, length = 4, 11
    table = torch.tensor([2, 0, 3])
    cache = torch.zeros(4, block_size, dims.kv_lora_rank + dims.qk_rope_head_dim)
    x = torch.randn(length, dims.hidden_size)
    positions = torch.arange(length)
    slots = table[positions // block_size] * block_size + positions % block_size

    prefill = AttentionMetadata(block_size, slots, [PrefillSegment(0, length, length, table)], length)
    expanded = mla(x, ForwardBatch(positions, positions, prefill), cache, rotary)[-1]
    decode = AttentionMetadata(
        block_size,
        slots[-1:],
        [],
        0,
        num_decodes=1,
        decode_block_tables=table[None],
        decode_seq_lens=torch.tensor([length]),
        max_decode_seq_len=length,
    )
    absorbed = mla(x[-1:], ForwardBatch(positions[-1:], positions[-1:], decode), cache, rotary)[0]
    torch.testing.assert_close(absorbed, expanded, rtol=1e-5, atol=1e-5)
