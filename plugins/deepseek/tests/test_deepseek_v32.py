"""DeepSeek-V3.2 (MLA + DSA lightning indexer) on the reference path against transformers, float32.

The tiny checkpoint's ``index_topk`` is 4, so past the fourth position every query attends to a selected
subset of its context and a wrong indexer (rope pairing, scales, causal mask, cache) changes the tokens.
With ``index_topk`` at least the context the model must equal DeepSeek-V3 on the same weights.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pegainfer import LLM, SamplingParams
from pegainfer.engine.request import Request
from pegainfer.errors import CheckpointError
from pegainfer.executor.executor import ModelBatch, SequenceChunk
from pegainfer.plugins.tiny_checkpoints import to_new_layout
from pegainfer.testing.conformance import (
    greedy_token_ids,
    hf_greedy,
    hf_logits,
    hf_model,
    random_prompts,
    relative_error,
    unused_checkpoint_tensors,
)
from pegainfer_deepseek.config import DeepseekV3Dims
from pegainfer_deepseek.indexer import INDEXER_CACHE
from pegainfer_deepseek.tiny import deepseek_v32_config

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_v32(tiny_checkpoint_factory: Callable[..., Path]) -> Path:
    return tiny_checkpoint_factory("deepseek_v32")


@pytest.fixture(scope="module")
def llm_v32(tiny_v32: Path) -> LLM:
    return LLM(str(tiny_v32), dtype="float32", device="cpu", cpu_kv_cache_bytes=8 << 20)


def _prefill(llm: LLM, rid: str, tokens: list[int], all_logits: bool = True):
    engine = llm.engine
    request = Request(rid, tokens, GREEDY)
    assert engine.buffers.allocate_slots(request, len(tokens))
    chunk = SequenceChunk(
        rid, tokens, 0, engine.buffers.block_table(rid), needs_logits=True, all_logits=all_logits
    )
    out = engine.executor.execute(ModelBatch([chunk]))
    return request, out


# ------------------------------------------------------------------------------------------------ config


def _v32_dims(**overrides) -> DeepseekV3Dims:
    return DeepseekV3Dims.from_hf_config(to_new_layout(deepseek_v32_config(1024, **overrides)))


def test_config_parses_the_indexer():
    dims = _v32_dims(rope_interleave=False)
    assert dims.indexer is not None
    assert (dims.indexer.n_heads, dims.indexer.head_dim, dims.indexer.topk) == (8, 32, 4)
    assert dims.rope.interleaved  # V3.2's MLA always interleaves, whatever rope_interleave says
    assert _v32_dims(mlp_layer_types=["dense", "sparse", "sparse"]).indexer is not None


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"q_lora_rank": None}, "needs q_lora_rank"),
        ({"index_head_dim": 8}, "exceeds index_head_dim"),
        ({"mlp_layer_types": ["sparse", "sparse", "sparse"]}, "mlp_layer_types"),
    ],
)
def test_unsupported_v32_settings_are_refused(override, message):
    with pytest.raises(CheckpointError, match=message):
        _v32_dims(**override)


# -------------------------------------------------------------------------------------------- the caches


def test_every_layer_has_a_latent_and_an_indexer_cache(llm_v32):
    dims = llm_v32.engine.executor.runner.model.dims
    caches = llm_v32.engine.executor.runner.buffers.caches
    layers = list(range(dims.num_layers))
    assert set(caches) == {*layers, *((layer, INDEXER_CACHE) for layer in layers)}
    for layer in layers:
        assert caches[layer].shape[-1] == dims.kv_lora_rank + dims.qk_rope_head_dim
        index_cache = caches[(layer, INDEXER_CACHE)]
        assert index_cache.shape == (*caches[layer].shape[:2], dims.indexer.head_dim)
    assert llm_v32.engine.executor.runner.model.num_mtp_layers == 0


def test_memory_plan_reserves_each_decode_rows_selection_over_max_model_len(tiny_v32):
    """In a decode graph the indexer ranks every position up to ``max_model_len`` for each row: the plan's
    per-sequence reserve for it must follow that bound."""

    def reserve(folder, max_model_len):
        llm = LLM(
            str(folder),
            dtype="float32",
            device="cpu",
            cpu_kv_cache_bytes=8 << 20,
            max_model_len=max_model_len,
        )
        specs = llm.engine.executor.runner.model.transient_specs()
        return sum(spec.bytes_per_seq for spec in specs if spec.role == "deepseek_indexer_decode")

    short, long = reserve(tiny_v32, 256), reserve(tiny_v32, 1024)
    assert short >= 256 * 4 and long - short == 768 * 4


def test_checkpoint_tensors_are_all_read(tiny_v32):
    assert unused_checkpoint_tensors(tiny_v32) == []


def test_cached_indexer_keys_equal_transformers_cache(llm_v32, tiny_v32):
    """The roped (half-split) and normed indexer keys per token and layer, against transformers' cache."""
    prompt = random_prompts(9, [13])[0]
    request, _ = _prefill(llm_v32, "cache-probe", prompt, all_logits=False)
    engine, dims = llm_v32.engine, llm_v32.engine.executor.runner.model.dims
    bs = engine.buffers.block_size
    table = torch.tensor(engine.buffers.block_table("cache-probe"))
    positions = torch.arange(len(prompt))
    slots = table[positions // bs] * bs + positions % bs
    with torch.no_grad():
        hf_cache = hf_model(str(tiny_v32))(torch.tensor([prompt]), use_cache=True).cache
    try:
        for layer in range(dims.num_layers):
            ours = engine.executor.runner.buffers.caches[(layer, INDEXER_CACHE)].flatten(0, 1)[slots]
            ref = hf_cache.layers[layer].indexer_keys[0]
            torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    finally:
        engine.buffers.free(request)


# -------------------------------------------------------------------------------- against transformers


@pytest.mark.parametrize(
    "options",
    [
        {"layout": "legacy"},
        {"rope_scaling": None},
        {"index_topk": 1, "index_n_heads": 4, "index_head_dim": 16},
        {"index_topk": 7, "attention_bias": True, "first_k_dense_replace": 0},
    ],
    ids=["legacy-layout", "plain-rope", "topk-1", "topk-7-bias-all-moe"],
)
def test_checkpoint_variants_match_hf(tiny_checkpoint_factory, options):
    folder = tiny_checkpoint_factory("deepseek_v32", seed=7, **options)
    assert unused_checkpoint_tensors(folder) == []
    llm = LLM(str(folder), dtype="float32", device="cpu", cpu_kv_cache_bytes=4 << 20)
    prompts = random_prompts(7, [9, 21])
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert greedy_token_ids(llm, prompts, params) == hf_greedy(folder, prompts, 12)
    _, out = _prefill(llm, "probe", prompts[1])
    assert relative_error(out.all_logits["probe"], hf_logits(folder, prompts[1])) < 1e-4


# ------------------------------------------------------------------------------------- dense equivalence


def test_topk_covering_the_context_is_dense_v3_and_a_small_topk_is_not(tiny_checkpoint_factory):
    """Same seed, same V3 weights: with ``index_topk`` above the context V3.2 is V3 exactly; with the
    tiny checkpoint's ``index_topk`` of 4 the selection changes the logits."""
    v3 = tiny_checkpoint_factory("deepseek_v3", seed=11, num_nextn_predict_layers=0)
    dense = tiny_checkpoint_factory("deepseek_v32", seed=11, index_topk=512)
    sparse = tiny_checkpoint_factory("deepseek_v32", seed=11)
    prompt = random_prompts(10, [40])[0]
    logits = {}
    for name, folder in (("v3", v3), ("dense", dense), ("sparse", sparse)):
        llm = LLM(str(folder), dtype="float32", device="cpu", cpu_kv_cache_bytes=4 << 20)
        request, out = _prefill(llm, name, prompt)
        llm.engine.buffers.free(request)
        logits[name] = out.all_logits[name]
    assert relative_error(logits["dense"], logits["v3"]) < 1e-6
    # The first 4 positions see at most 4 keys: identical; later ones attend to a subset.
    assert relative_error(logits["sparse"][:4], logits["v3"][:4]) < 1e-6
    assert relative_error(logits["sparse"][4:], logits["v3"][4:]) > 1e-2
