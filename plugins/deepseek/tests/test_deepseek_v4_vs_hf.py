"""DeepSeek-V4 on the reference path against transformers, float32.

The tiny checkpoint (``pegainfer_deepseek.tiny_v4``) has a sliding-only, two CSA (ratio 4,
indexer top-3) and one HCA (ratio 8) layer with a window of 8 tokens: prompts of 20+ tokens slide the
window and close several compressed windows, and past 12 tokens the indexer's choice matters.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pegainfer import LLM, SamplingParams
from pegainfer.config.schema import EngineConfig, ModelConfig
from pegainfer.engine.request import Request
from pegainfer.errors import CheckpointError
from pegainfer.executor.executor import ModelBatch, SequenceChunk
from pegainfer.memory.buffer_specs import PagedCompressedSpec, RecurrentStateSpec
from pegainfer.model.checkpoint import CheckpointReader
from pegainfer.model.model_loader import load_model
from pegainfer.testing.conformance import (
    greedy_token_ids,
    hf_greedy,
    hf_logits,
    hf_model,
    random_prompts,
    relative_error,
    unused_checkpoint_tensors,
)
from pegainfer_deepseek.indexer import INDEXER_CACHE
from pegainfer_deepseek.tiny import write_fp8_copy
from pegainfer_deepseek.tiny_v4 import deepseek_v4_config
from pegainfer_deepseek.v4_config import DeepseekV4Dims

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_v4(tiny_checkpoint_factory: Callable[..., Path]) -> Path:
    return tiny_checkpoint_factory("deepseek_v4")


@pytest.fixture(scope="module")
def llm_v4(tiny_v4: Path) -> LLM:
    return LLM(str(tiny_v4), dtype="float32", device="cpu", cpu_kv_cache_bytes=8 << 20)


def _run_chunks(llm: LLM, rid: str, tokens: list[int], cuts: list[int]) -> list[torch.Tensor]:
    """Teacher-forced: the prompt in chunks ending at ``cuts`` (then at its end); the logits of every
    position (``[len(tokens), V]``)."""
    engine, executor = llm.engine, llm.engine.executor
    request = Request(rid, tokens, GREEDY)
    assert engine.buffers.allocate_slots(request, len(tokens))
    table, slot = engine.buffers.block_table(rid), engine.buffers.state_slot(rid)
    logits, start = [], 0
    for end in [*cuts, len(tokens)]:
        part = tokens[start:end]
        chunk = SequenceChunk(rid, part, start, table, needs_logits=True, all_logits=True, state_slot=slot)
        out = executor.execute(ModelBatch([chunk]))
        logits.append(out.all_logits[rid])
        start = end
    engine.buffers.free(request)
    return torch.cat(logits)


# -------------------------------------------------------------------------------------------- buffers


def test_buffers_per_layer_kind(llm_v4):
    """Every layer has a state slot (window ring, compressor rings); CSA/HCA layers page their compressed
    entries, CSA layers their indexer keys too; the memory plan counts every page of them."""
    engine, dims = llm_v4.engine, llm_v4.engine.executor.runner.model.dims
    specs = engine.executor.runner.model.buffer_specs()
    states = {s.layer_index: dict(s.shapes) for s in specs if isinstance(s, RecurrentStateSpec)}
    paged = {s.key: s for s in specs if isinstance(s, PagedCompressedSpec)}
    assert states[0] == {"window": (8, 32)}  # sliding only
    assert states[1] == {"window": (8, 32), "compressor": (4, 128), "indexer": (4, 64)}  # CSA (ratio 2)
    assert states[2] == {"window": (8, 32), "compressor": (8, 64)}  # HCA
    assert set(paged) == {1, 2, 3, (1, INDEXER_CACHE), (3, INDEXER_CACHE)}
    assert (paged[1].ratio, paged[2].ratio, paged[(1, INDEXER_CACHE)].entry_dim) == (2, 8, 16)
    plan, bs = engine.buffers.plan, engine.buffers.block_size
    assert plan.page_bytes == sum(s.page_bytes(bs) for s in paged.values())
    assert plan.transients["deepseek_v4_attention_scratch"] > 0
    assert plan.state_bytes_per_slot == sum(
        s.bytes_per_request for s in specs if isinstance(s, RecurrentStateSpec)
    )
    assert engine.executor.runner.buffers.caches[2].shape[1:] == (-(-bs // 8), dims.head_dim)


def test_checkpoint_tensors_are_all_read(tiny_v4):
    assert unused_checkpoint_tensors(tiny_v4) == []


def test_release_names_load_and_match(tiny_checkpoint_factory, tiny_v4):
    """DeepSeek's release spelling (``embed.weight``, ``layers.0.attn.wq_a.weight``, ``hc_head_fn``) loads
    to the same model (same seed, same tensors)."""
    release = tiny_checkpoint_factory("deepseek_v4", release_names=True)
    assert "embed.weight" in CheckpointReader(release)
    assert unused_checkpoint_tensors(release) == []
    prompt = random_prompts(6, [21])[0]
    logits = []
    for folder in (tiny_v4, release):
        llm = LLM(str(folder), dtype="float32", device="cpu", cpu_kv_cache_bytes=4 << 20)
        logits.append(_run_chunks(llm, "names", prompt, []))
    assert torch.equal(logits[0], logits[1])


@pytest.mark.parametrize(
    ("drop", "reshape", "message"),
    [
        ("model.layers.2.attn.compressor.ape", None, "'layers.2.attn.compressor.ape' is missing"),
        (None, "model.layers.1.attn.indexer.wq_b.weight", "has shape"),
        ("model.layers.0.ffn.gate.tid2eid", None, "'layers.0.ffn.gate.tid2eid' is missing"),
    ],
)
def test_missing_or_misshaped_tensors_are_named(tmp_path, tiny_v4, drop, reshape, message):
    for file in tiny_v4.iterdir():
        if file.suffix != ".safetensors":
            (tmp_path / file.name).write_bytes(file.read_bytes())
    tensors = load_file(str(tiny_v4 / "model.safetensors"))
    if drop:
        del tensors[drop]
    if reshape:
        tensors[reshape] = tensors[reshape][:-1].contiguous()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=message):
        load_model(EngineConfig(model=ModelConfig(name="auto", path=str(tmp_path)), device="cpu"))


# -------------------------------------------------------------------------------- against transformers


def test_query_blocks_give_the_same_logits(monkeypatch, llm_v4, tiny_v4):
    """The reference attention and indexer walk long chunks a query block at a time (256 queries); with
    5-query blocks the 53-token prompt crosses many block edges."""
    import pegainfer_deepseek.v4_attention as attention
    import pegainfer_deepseek.v4_indexer as indexer

    monkeypatch.setattr(attention, "QUERY_BLOCK", 5)
    monkeypatch.setattr(indexer, "QUERY_BLOCK", 5)
    prompt = random_prompts(4, [53])[0]
    assert relative_error(_run_chunks(llm_v4, "blocks", prompt, [17]), hf_logits(tiny_v4, prompt)) < 1e-4


def test_uneven_chunks_and_decode_logits_within_tolerance(llm_v4, tiny_v4):
    """Chunks cut mid-window (3, 7, 10, 13, 22), then one-token decode steps, against one forward."""
    prompt = random_prompts(5, [40])[0]
    ours = _run_chunks(llm_v4, "chunk-probe", prompt, [3, 7, 10, 13, 22, *range(30, 40)])
    err = relative_error(ours, hf_logits(tiny_v4, prompt))
    print(f"chunked + decode logits rel err: {err:.2e}")
    assert err < 1e-4


@pytest.mark.parametrize(
    "options",
    [
        {"layout": "legacy"},
        {"index_topk": 64, "hc_mult": 2, "sliding_window": 5},
        {
            "layer_types": ["heavily_compressed_attention"] * 2 + ["sliding_attention"] * 2,
            "tie_word_embeddings": True,
        },
    ],
    ids=["legacy-layout", "dense-topk-2-streams-window-5", "hca-first-tied"],
)
def test_checkpoint_variants_match_hf(tiny_checkpoint_factory, options):
    folder = tiny_checkpoint_factory("deepseek_v4", seed=7, **options)
    assert unused_checkpoint_tensors(folder) == []
    llm = LLM(str(folder), dtype="float32", device="cpu", cpu_kv_cache_bytes=4 << 20)
    prompts = random_prompts(7, [9, 26])
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert greedy_token_ids(llm, prompts, params) == hf_greedy(folder, prompts, 12)
    assert relative_error(_run_chunks(llm, "probe", prompts[1], [11]), hf_logits(folder, prompts[1])) < 1e-4


def test_transformers_module_names_load_and_match(tmp_path, tiny_v4):
    """A folder holding transformers' own parameter names (``model.layers.1.self_attn.q_a_proj.weight``,
    fused ``mlp.experts.gate_up_proj``), as its state dict has them, loads to the same model."""
    for file in tiny_v4.iterdir():
        if file.suffix != ".safetensors":
            (tmp_path / file.name).write_bytes(file.read_bytes())
    state = {k: v.contiguous() for k, v in hf_model(str(tiny_v4)).state_dict().items()}
    assert "model.layers.1.self_attn.compressor.indexer.scorer.weights_proj.weight" in state
    save_file(state, str(tmp_path / "model.safetensors"))
    assert unused_checkpoint_tensors(tmp_path) == []
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", cpu_kv_cache_bytes=4 << 20)
    prompt = random_prompts(8, [23])[0]
    assert relative_error(_run_chunks(llm, "modules", prompt, [9]), hf_logits(tiny_v4, prompt)) < 1e-4


def test_dummy_weights_generate(tiny_v4):
    """``load_format=dummy`` (benchmarks): random weights of the real shapes, the hash tables valid."""
    config = ModelConfig(path=str(tiny_v4), load_format="dummy", dtype="float32")
    llm = LLM.from_config(EngineConfig(model=config, device="cpu"))
    tokens = greedy_token_ids(llm, random_prompts(9, [19]))[0]
    assert len(tokens) == 24


def test_fp8_checkpoint_equals_its_dequantized_weights(tiny_checkpoint_factory, tmp_path_factory):
    """Block-FP8 projections (32×32 blocks here, so each spans several) dequantize at load: the model
    equals the one stored with the dequantized values, which transformers also runs."""
    source = tiny_checkpoint_factory("deepseek_v4", seed=3)
    root = tmp_path_factory.mktemp("v4-fp8")
    fp8 = write_fp8_copy(source, root / "fp8", block_size=(32, 32))
    plain = write_fp8_copy(source, root / "dequantized", block_size=(32, 32), dequantized=True)
    assert "model.layers.1.attn.compressor.wkv.weight_scale_inv" in CheckpointReader(fp8)
    assert unused_checkpoint_tensors(fp8) == []
    prompt = random_prompts(11, [27])[0]
    logits = [
        _run_chunks(LLM(str(f), dtype="float32", device="cpu", cpu_kv_cache_bytes=4 << 20), "fp8", prompt, [])
        for f in (fp8, plain)
    ]
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)
    assert relative_error(logits[1], hf_logits(plain, prompt)) < 1e-4


def test_fp4_experts_are_refused():
    config = deepseek_v4_config(1024, expert_dtype="fp4")
    with pytest.raises(CheckpointError, match="FP4"):
        DeepseekV4Dims.from_hf_config(config)
