"""What one tensor-parallel rank of Qwen3.5 holds (fast, no collectives): the counts tp must divide are
checked before any weight is read, and rank 1 reads exactly its heads of every packed tensor."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from pegainfer.errors import ConfigError
from pegainfer.model.checkpoint import CheckpointReader, read_hf_config
from pegainfer.parallel.distributed import TensorParallel
from pegainfer_qwen35.config import Qwen35Config
from pegainfer_qwen35.model import Qwen35ForCausalLM
from pegainfer_qwen35.projections import fold_norm
from pegainfer_qwen35.tiny import qwen3_5_config, qwen3_5_moe_config


def _rank(rank: int = 0, size: int = 2) -> TensorParallel:
    # A construction-only group: no collective is called in these tests.
    return TensorParallel(rank=rank, size=size, group=object())


def _build(hf_config: dict, tp: TensorParallel) -> Qwen35ForCausalLM:
    config = Qwen35Config.from_hf_config(hf_config)
    return Qwen35ForCausalLM(config, dtype=torch.float32, max_model_len=64, tp=tp)


@pytest.mark.parametrize(
    ("make", "overrides", "count"),
    [
        (qwen3_5_config, {"linear_num_key_heads": 3, "linear_num_value_heads": 6}, "linear_num_key_heads: 3"),
        (qwen3_5_config, {"num_attention_heads": 3, "num_key_value_heads": 1}, "num_attention_heads: 3"),
        (qwen3_5_config, {"intermediate_size": 127}, "intermediate_size: 127"),
        (qwen3_5_moe_config, {"moe_intermediate_size": 33}, "moe_intermediate_size: 33"),
    ],
    ids=["gdn-key-heads", "query-heads", "mlp", "moe-experts"],
)
def test_counts_tp_does_not_divide_fail_naming_them(make, overrides, count):
    with pytest.raises(ConfigError, match=count):
        _build(make(256, **overrides), _rank())


def test_kv_heads_fewer_than_ranks_are_replicated():
    model = _build(qwen3_5_config(256, num_key_value_heads=1), _rank(1))
    assert (model.shard.num_heads, model.shard.num_kv_heads, model.shard.kv_pieces) == (2, 1, 1)


def test_rank_one_reads_its_heads_of_every_packed_tensor(tiny_checkpoint_factory):
    folder = tiny_checkpoint_factory("qwen3_5", vocab_size=1001)
    full = load_file(str(folder / "model.safetensors"))
    model = _build(read_hf_config(folder), _rank(1))
    model.load_weights(CheckpointReader(folder, rank=1, world_size=2))
    c = model.config
    hk, dk, dv = c.linear_num_key_heads // 2, c.linear_key_head_dim, c.linear_value_head_dim
    hv = c.linear_num_value_heads // 2
    kd, vd = c.key_dim, c.value_dim

    gdn = model.layers[0].mixer  # a linear_attention layer
    p = "model.language_model.layers.0.linear_attn."
    qkv = full[p + "in_proj_qkv.weight"]
    # Rank 1's q heads | its k heads | its v heads, not the second half of the packed rows.
    mine = torch.cat([qkv[hk * dk : kd], qkv[kd + hk * dk : 2 * kd], qkv[2 * kd + hv * dv : 2 * kd + vd]])
    # The layer's input norm rides folded in its first projection (fold_norm), on every rank's rows.
    norm = full["model.language_model.layers.0.input_layernorm.weight"]
    q_k_v, z, b, a = gdn.in_proj.split(gdn.splits)
    torch.testing.assert_close(q_k_v, fold_norm(mine, norm), rtol=0, atol=0)
    torch.testing.assert_close(z, fold_norm(full[p + "in_proj_z.weight"][hv * dv :], norm), rtol=0, atol=0)
    torch.testing.assert_close(b, fold_norm(full[p + "in_proj_b.weight"][hv:], norm), rtol=0, atol=0)
    torch.testing.assert_close(a, fold_norm(full[p + "in_proj_a.weight"][hv:], norm), rtol=0, atol=0)
    conv = full[p + "conv1d.weight"][:, 0]
    mine_conv = torch.cat(
        [conv[hk * dk : kd], conv[kd + hk * dk : 2 * kd], conv[2 * kd + hv * dv : 2 * kd + vd]]
    )
    torch.testing.assert_close(gdn.conv_weight, mine_conv, rtol=0, atol=0)
    torch.testing.assert_close(gdn.A_log, full[p + "A_log"][hv:], rtol=0, atol=0)
    torch.testing.assert_close(gdn.norm, full[p + "norm.weight"], rtol=0, atol=0)  # replicated
    torch.testing.assert_close(gdn.out_proj, full[p + "out_proj.weight"][:, hv * dv :], rtol=0, atol=0)
    assert dict(gdn.state_spec().shapes) == {
        "conv": (2 * hk * dk + hv * dv, c.conv_kernel - 1),
        "ssm": (hv, dk, dv),
    }

    attn = model.layers[1].mixer  # the full_attention layer: rank 1's heads with their own gates
    p = "model.language_model.layers.1.self_attn."
    nq, d = c.num_heads // 2, c.head_dim
    norm = full["model.language_model.layers.1.input_layernorm.weight"]
    query_gate = attn.qkv_proj[: 2 * nq * d]
    mine_query_gate = fold_norm(full[p + "q_proj.weight"][2 * nq * d :], norm)
    torch.testing.assert_close(query_gate, mine_query_gate, rtol=0, atol=0)
    assert attn.cache_spec().num_kv_heads == c.num_kv_heads // 2

    # Vocab-parallel lm_head: rows 501..1000 and one zero row of padding.
    lm_head = full["lm_head.weight"]
    assert model.lm_head.shape == (501, c.hidden_size)
    torch.testing.assert_close(model.lm_head[:500], lm_head[501:], rtol=0, atol=0)
    assert not model.lm_head[500].any()


def test_pass_buffers_and_states_are_rank_local(tiny_checkpoint_factory):
    # Two KV heads, so every attention width halves (the default's one KV head is replicated).
    hf = read_hf_config(tiny_checkpoint_factory("qwen3_5_moe", num_key_value_heads=2))
    one, two = _build(hf, TensorParallel()), _build(hf, _rank())
    widths = {r.name: r.width for r in one.pass_buffer_roles}
    halves = {r.name: r.width for r in two.pass_buffer_roles}
    whole = {"hidden", "normed", "mixer_out", "mlp_down", "moe_router", "moe_rows", "moe_out"}
    for name, width in widths.items():
        assert halves[name] == (width if name in whole else width // 2), name
