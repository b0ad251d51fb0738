"""Qwen3-Next in the qwen35 plugin: its config keys, its fused GDN projections, and loader bugs that the
conformance suite's logits check must catch (the suite itself runs in ``test_qwen35_conformance.py``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pegainfer.errors import CheckpointError, ConfigError
from pegainfer.model.checkpoint import CheckpointReader, read_hf_config
from pegainfer.parallel.distributed import TensorParallel
from pegainfer.testing.conformance import Mutation, forget, mutated_engine, mutation_errors
from pegainfer.testing.suite import PluginConformance
from pegainfer_qwen35.config import Qwen35Config, Qwen35Shard
from pegainfer_qwen35.gated_deltanet import GatedDeltaNet
from pegainfer_qwen35.model import Qwen35ForCausalLM
from pegainfer_qwen35.tiny import qwen3_5_moe_config, qwen3_next_config

MODEL = "qwen35"
TOLERANCE = PluginConformance.logits_tolerance


@pytest.fixture(scope="module")
def tiny_qwen3_next(tiny_checkpoint_factory: Callable[..., Path]) -> Path:
    return tiny_checkpoint_factory("qwen3_next")


def test_config_reads_the_qwen3_next_keys() -> None:
    c = Qwen35Config.from_hf_config(qwen3_next_config(1024))
    assert c.fused_gdn_projections and not c.norm_topk_prob
    # decoder_sparse_step 2 makes layers 1, 3, 5 candidates; mlp_only_layers [5] keeps 5 dense.
    assert c.moe_layers == (1, 3)
    assert [c.is_moe_layer(i) for i in range(6)] == [False, True, False, True, False, False]
    assert c.is_moe and c.has_dense_ffn and c.intermediate_size == 128


def test_all_dense_when_every_layer_is_mlp_only() -> None:
    c = Qwen35Config.from_hf_config(qwen3_next_config(1024, mlp_only_layers=[0, 1, 2, 3, 4, 5]))
    assert not c.is_moe and c.has_dense_ffn


def test_qwen3_5_moe_keeps_every_layer_sparse_and_renormalised() -> None:
    # Qwen3.5-MoE has no mlp_only_layers / decoder_sparse_step / norm_topk_prob: they are not read.
    config = qwen3_5_moe_config(1024)
    config["text_config"].update(decoder_sparse_step=2, norm_topk_prob=False)
    c = Qwen35Config.from_hf_config(config)
    assert c.moe_layers is None and c.norm_topk_prob and not c.fused_gdn_projections
    assert c.is_moe and not c.has_dense_ffn


@pytest.mark.parametrize(
    "overrides, match",
    [({"decoder_sparse_step": 0}, "decoder_sparse_step"), ({"mlp_only_layers": [6]}, "mlp_only_layers")],
)
def test_bad_sparsity_keys_are_refused(overrides: dict, match: str) -> None:
    with pytest.raises(CheckpointError, match=match):
        Qwen35Config.from_hf_config(qwen3_next_config(1024, **overrides))


def test_tensor_parallel_splits_whole_key_head_groups() -> None:
    # The fused rows are grouped by key head: a rank holds whole groups, so the key heads must divide.
    c = Qwen35Config.from_hf_config(qwen3_next_config(1024))
    shard = Qwen35Shard.of(c, TensorParallel(rank=1, size=2, group=object()))
    assert (shard.linear_num_key_heads, shard.linear_num_value_heads) == (1, 2)
    assert shard.intermediate_size == 64 and shard.moe_intermediate_size == 16
    with pytest.raises(ConfigError, match="linear_num_key_heads"):
        Qwen35Shard.of(c, TensorParallel(rank=0, size=4, group=object()))


def _loaded(folder: Path, tp: TensorParallel) -> Qwen35ForCausalLM:
    config = Qwen35Config.from_hf_config(read_hf_config(folder))
    model = Qwen35ForCausalLM(config, dtype=torch.float32, max_model_len=64, tp=tp)
    model.load_weights(CheckpointReader(folder, rank=tp.rank, world_size=tp.size))
    return model


def test_rank_one_reads_its_key_head_groups_of_the_fused_projections(tiny_qwen3_next: Path) -> None:
    # The one-rank model (de-interleaved, its logits checked against transformers) is the oracle: rank 1
    # holds the second half of each of its q, k, v, z, b and a blocks.
    one = _loaded(tiny_qwen3_next, TensorParallel())
    two = _loaded(tiny_qwen3_next, TensorParallel(rank=1, size=2, group=object()))
    c = one.config
    kd, vd, hv = c.key_dim, c.value_dim, c.linear_num_value_heads
    for whole, rank_one in zip(one.layers, two.layers, strict=True):
        if not isinstance(whole.mixer, GatedDeltaNet):
            continue
        blocks = whole.mixer.in_proj.split([kd, kd, vd, vd, hv, hv])
        mine = torch.cat([blk[blk.shape[0] // 2 :] for blk in blocks])
        torch.testing.assert_close(rank_one.mixer.in_proj, mine, rtol=0, atol=0)
        torch.testing.assert_close(rank_one.mixer.A_log, whole.mixer.A_log[hv // 2 :], rtol=0, atol=0)


def _grouped(num_key_heads: int, *parts: torch.Tensor) -> torch.Tensor:
    """The rows of ``parts`` interleaved per key head, as the fused Qwen3-Next tensors store them."""
    h = parts[0].shape[-1]
    return torch.cat([t.reshape(num_key_heads, -1, h) for t in parts], dim=1).reshape(-1, h)


def _not_deinterleaved(model) -> None:
    """The bug of a loader that reads ``in_proj_qkvz`` / ``in_proj_ba`` as if they were [q|k|v|z], [b|a]."""
    layers = [m for m in model.modules() if isinstance(m, GatedDeltaNet)]
    assert layers
    for layer in layers:
        c, w = layer.config, layer.in_proj
        hk, hv = c.linear_num_key_heads, c.linear_num_value_heads
        q, k, v, z, b, a = w.split([c.key_dim, c.key_dim, c.value_dim, c.value_dim, hv, hv])
        w.copy_(torch.cat([_grouped(hk, q, k, v, z), _grouped(hk, b, a)]))


MUTATIONS = [
    Mutation("norm_topk_prob-ignored", config=forget("norm_topk_prob")),
    Mutation("fused-projections-not-deinterleaved", model=_not_deinterleaved),
]

#: Keys a loader cannot ignore without building layers of the wrong kind: it must refuse.
REFUSED = ["decoder_sparse_step", "mlp_only_layers", "intermediate_size"]


@pytest.mark.parametrize("mutation", MUTATIONS, ids=str)
def test_mutation_fails_the_logits_check(tiny_qwen3_next: Path, tmp_path: Path, mutation: Mutation) -> None:
    prefill, decode = mutation_errors(MODEL, tiny_qwen3_next, mutation, tmp_path)
    print(f"{mutation}: prefill {prefill:.2e}, decode {decode:.2e}")
    assert prefill > TOLERANCE and decode > TOLERANCE, (prefill, decode)


@pytest.mark.parametrize("key", REFUSED)
def test_ignoring_a_layer_kind_key_is_refused(tiny_qwen3_next: Path, tmp_path: Path, key: str) -> None:
    with pytest.raises(CheckpointError, match="shape|missing|lacks"):
        mutated_engine(MODEL, tiny_qwen3_next, Mutation(f"{key}-ignored", config=forget(key)), tmp_path)


def test_mtp_drafting_keeps_the_greedy_tokens(tiny_qwen3_next: Path) -> None:
    """Qwen3-Next's MTP module (the same layout as Qwen3.5's, a sparse decoder layer) drafts, and every
    rejection rolls the GDN state back: greedy tokens equal those without drafting."""
    from pegainfer import LLM
    from pegainfer.testing.conformance import random_prompts
    from pegainfer.testing.speculative import generate_counting, token_ids

    prompts = random_prompts(9, [6, 19, 2])
    runs = []
    for k in (0, 2):
        llm = LLM(
            str(tiny_qwen3_next),
            dtype="float32",
            device="cpu",
            cpu_kv_cache_bytes=32 << 20,
            speculative_num_tokens=k,
        )
        assert llm.engine.executor.runner.model.num_mtp_layers == (1 if k else 0)
        runs.append(generate_counting(llm, prompts))
    (plain, _), (drafted, stats) = runs
    assert token_ids(drafted) == token_ids(plain)
    assert stats["spec_draft_tokens"] > 0
