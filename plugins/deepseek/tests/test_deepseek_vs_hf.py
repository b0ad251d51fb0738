"""DeepSeek-V3 on the reference path against HF transformers, float32: greedy tokens identical, logits close.

Prefill runs the expanded MLA form, decode the absorbed form over the latent cache; both are compared
with transformers' teacher-forced logits. V3 embeds its tokens in ``forward`` (``embeds_on_device``), so
it runs the engine's decode-graph path (``test_deepseek_graph_path.py``); V3.2 is handed its embeddings,
and called without them fails clearly.
"""

from __future__ import annotations

import pytest
import torch

from pegainfer import LLM, SamplingParams
from pegainfer.engine.request import Request
from pegainfer.errors import ExecutorError
from pegainfer.executor.executor import ModelBatch, SequenceChunk
from pegainfer.layers.attention import AttentionMetadata
from pegainfer.model.model_api import ForwardBatch
from pegainfer.testing.conformance import (
    greedy_token_ids,
    hf_greedy,
    hf_logits,
    random_prompts,
    relative_error,
    unused_checkpoint_tensors,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def test_cache_holds_the_compressed_latent_only(llm):
    dims = llm.engine.executor.runner.model.dims
    caches = llm.engine.executor.runner.buffers.caches
    assert sorted(caches) == list(range(dims.num_layers))
    for cache in caches.values():
        assert cache.shape[-1] == dims.kv_lora_rank + dims.qk_rope_head_dim
        assert cache.dim() == 3  # [blocks, block_size, latent + rope]: no per-head K/V


def test_cached_latents_equal_transformers_cache(llm, tiny_deepseek):
    """Per token and layer: transformers' cached ``kv_a_layernorm`` output and roped shared key (which it
    writes de-interleaved), against the page slots the engine wrote."""
    from pegainfer.testing.conformance import hf_model

    prompt = random_prompts(9, [13])[0]
    request, _ = _prefill(llm, "cache-probe", prompt, all_logits=False)
    engine, dims = llm.engine, llm.engine.executor.runner.model.dims
    table = torch.tensor(engine.buffers.block_table("cache-probe"))
    positions = torch.arange(len(prompt))
    slots = (
        table[positions // engine.buffers.block_size] * engine.buffers.block_size
        + positions % engine.buffers.block_size
    )
    with torch.no_grad():
        hf_cache = hf_model(str(tiny_deepseek))(torch.tensor([prompt]), use_cache=True).cache
    try:
        for layer in range(dims.num_layers):
            ours = engine.executor.runner.buffers.caches[layer].flatten(0, 1)[slots]
            latent, k_pe = ours[:, : dims.kv_lora_rank], ours[:, dims.kv_lora_rank :]
            k_pe = torch.cat([k_pe[:, 0::2], k_pe[:, 1::2]], dim=-1)
            torch.testing.assert_close(latent, hf_cache.layers[layer].keys[0, 0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(k_pe, hf_cache.layers[layer].values[0, 0], rtol=1e-5, atol=1e-5)
    finally:
        engine.buffers.free(request)


def _prefill(llm: LLM, rid: str, tokens: list[int], all_logits: bool = True):
    engine = llm.engine
    request = Request(rid, tokens, GREEDY)
    assert engine.buffers.allocate_slots(request, len(tokens))
    chunk = SequenceChunk(
        rid, tokens, 0, engine.buffers.block_table(rid), needs_logits=True, all_logits=all_logits
    )
    out = engine.executor.execute(ModelBatch([chunk]))
    return request, out


@pytest.mark.parametrize(
    "options",
    [
        {"q_lora_rank": None},
        {"layout": "legacy"},
        {"rope_scaling": None, "rope_interleave": False},
        {
            "rope_scaling": {
                "type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 512,
                "beta_fast": 16,
                "beta_slow": 2,
                "mscale": 1.0,
                "mscale_all_dim": 0.8,
            }
        },
        {"rope_scaling": {"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 128}},
        {"norm_topk_prob": True, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 0},
        {"n_shared_experts": 1, "num_experts_per_tok": 5, "n_group": 8, "topk_group": 3},
        {"attention_bias": True, "tie_word_embeddings": True},
        {"dtype": "bfloat16", "num_shards": 3},
    ],
    ids=[
        "no-q-lora",
        "legacy-layout",
        "plain-rope-half-split",
        "yarn-mscale-differs",
        "yarn-no-mscale-keys",
        "ungrouped-normalised",
        "one-shared-8-groups",
        "bias-tied",
        "bf16-sharded",
    ],
)
def test_checkpoint_variants_match_hf(tiny_checkpoint_factory, options):
    folder = tiny_checkpoint_factory("deepseek_v3", seed=7, **options)
    assert unused_checkpoint_tensors(folder) == []
    llm = LLM(str(folder), dtype="float32", device="cpu", cpu_kv_cache_bytes=4 << 20)
    prompts = random_prompts(7, [9, 21])
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert greedy_token_ids(llm, prompts, params) == hf_greedy(folder, prompts, 12)
    _, out = _prefill(llm, "probe", prompts[1])
    assert relative_error(out.all_logits["probe"], hf_logits(folder, prompts[1])) < 1e-4


@pytest.mark.parametrize("architecture", ["deepseek_v3", "deepseek_v32"])
def test_prefill_query_blocks_give_the_same_logits(monkeypatch, tiny_checkpoint_factory, architecture):
    """MLA prefill attends a query block at a time (256 queries); with 5-query blocks a 23-token prompt
    crosses several block edges, V3.2's indexer selection sliced along with them."""
    import pegainfer_deepseek.mla as mla

    monkeypatch.setattr(mla, "QUERY_BLOCK", 5)
    folder = tiny_checkpoint_factory(architecture)
    llm = LLM(str(folder), dtype="float32", device="cpu", cpu_kv_cache_bytes=4 << 20)
    prompt = random_prompts(3, [23])[0]
    _, out = _prefill(llm, "blocks", prompt)
    assert relative_error(out.all_logits["blocks"], hf_logits(folder, prompt)) < 1e-4


def test_v3_embeds_on_the_device_and_v32_does_not(llm, tiny_checkpoint_factory):
    assert llm.engine.executor.runner.model.embeds_on_device
    assert llm.engine.executor.capabilities.device_embedding
    v32 = LLM(
        str(tiny_checkpoint_factory("deepseek_v32")),
        dtype="float32",
        device="cpu",
        cpu_kv_cache_bytes=4 << 20,
    )
    model = v32.engine.executor.runner.model
    assert not model.embeds_on_device and not v32.engine.executor.capabilities.device_embedding
    ids = torch.tensor([1, 2, 3])
    meta = AttentionMetadata(block_size=16, slot_mapping=ids, prefills=[], num_prefill_tokens=3)
    with pytest.raises(ExecutorError, match="must carry hidden_states"):
        model(ForwardBatch(ids, torch.arange(3), meta), {}, {})


def test_forward_reads_the_hidden_states_not_the_token_ids(llm, tiny_deepseek, monkeypatch):
    # Token ids say one prompt, the runner's embeddings another: the logits follow the embeddings.
    engine = llm.engine
    said, meant = random_prompts(8, [6, 6])
    model = engine.executor.runner.model
    embed = model.embed
    monkeypatch.setattr(model, "embed", lambda ids: embed(torch.tensor(meant)))
    request = Request("r", said, GREEDY)
    assert engine.buffers.allocate_slots(request, len(said))
    chunk = SequenceChunk("r", said, 0, engine.buffers.block_table("r"), needs_logits=True)
    try:
        out = engine.executor.execute(ModelBatch([chunk]))
    finally:
        engine.buffers.free(request)
    assert relative_error(out.logits[0], hf_logits(tiny_deepseek, meant)[-1]) < 1e-4


def test_pages_default_to_the_models_size(llm, tiny_checkpoint_factory):
    """Left unset, ``cache.block_size`` is the model's: V3 64 tokens (its MLA decode kernel's in-page
    tiles), V3.2 16; set, it wins."""
    assert llm.engine.buffers.block_size == 64
    v32 = tiny_checkpoint_factory("deepseek_v32")
    assert LLM(str(v32), dtype="float32", device="cpu").engine.buffers.block_size == 16
    folder = tiny_checkpoint_factory("deepseek_v3")
    assert LLM(str(folder), dtype="float32", device="cpu", block_size=32).engine.buffers.block_size == 32
