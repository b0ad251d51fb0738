"""Qwen3 on the reference path against HF transformers, float32: greedy tokens identical, logits close."""

from __future__ import annotations

import pytest
import torch

from pegainfer import LLM, SamplingParams
from pegainfer.testing.checkpoints import write_tiny_checkpoint
from pegainfer.testing.conformance import (
    greedy_token_ids,
    hf_greedy,
    random_prompts,
    unused_checkpoint_tensors,
)


@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    return LLM(str(tiny_qwen3), dtype="float32", device="cpu", cpu_kv_cache_bytes=8 << 20)


@pytest.mark.parametrize(
    "options",
    [
        {"layout": "legacy"},
        {"num_shards": 3},
        {"num_shards": 2, "write_index": False},
        {"dtype": "bfloat16"},
        {"dtype": "float16"},
        {"tie_word_embeddings": True, "attention_bias": True},
        {"num_key_value_heads": 4, "head_dim": 8, "num_attention_heads": 8},
    ],
    ids=[
        "legacy-layout",
        "sharded-indexed",
        "sharded-no-index",
        "bf16-on-disk",
        "fp16-on-disk",
        "tied-bias",
        "gqa-1",
    ],
)
def test_checkpoint_variants_match_hf(tiny_checkpoint_factory, options):
    folder = tiny_checkpoint_factory("qwen3", seed=7, **options)
    assert unused_checkpoint_tensors(folder) == []
    llm = LLM(str(folder), dtype="float32", device="cpu", cpu_kv_cache_bytes=4 << 20)
    prompts = random_prompts(5, [9, 21])
    # transformers cannot open shards without an index: its reference is the same weights in one file.
    reference = folder if options.get("write_index", True) else tiny_checkpoint_factory("qwen3", seed=7)
    assert greedy_token_ids(
        llm, prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ) == hf_greedy(reference, prompts, 12)


def test_decode_rewrites_block_table_rows_only_when_pages_change(tiny_qwen3):
    llm = LLM(str(tiny_qwen3), dtype="float32", device="cpu", block_size=4, cpu_kv_cache_bytes=4 << 20)
    prompts = random_prompts(6, [3, 6, 9])
    greedy_token_ids(llm, prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    decode = llm.engine.executor.runner.decode
    # Each request's final table has ceil(len/4) pages; a row is written once per page plus the pages that
    # existed when it first decoded. Rewriting whole rows every step would write far more.
    pages = sum(-(-(len(p) + 20) // 4) for p in prompts)
    assert decode.block_entries_written <= pages
    llm.engine.buffers.check_invariants()


def test_missing_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    from pegainfer.errors import CheckpointError

    folder = write_tiny_checkpoint(tmp_path / "ckpt", "qwen3")
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        LLM(str(folder), device="cpu")


def test_misshaped_tensor_names_tensor_and_file(tmp_path):
    from safetensors.torch import load_file, save_file

    from pegainfer.errors import CheckpointError

    folder = write_tiny_checkpoint(tmp_path / "ckpt", "qwen3")
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.layers.0.self_attn.k_norm.weight"] = torch.ones(3)
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"k_norm\.weight' in model\.safetensors has shape \(3,\)"):
        LLM(str(folder), device="cpu")


def test_dummy_load_format_needs_no_weights(tmp_path):
    """load_format=dummy builds the real shapes with random weights from config.json alone."""
    folder = write_tiny_checkpoint(tmp_path / "ckpt", "qwen3")
    for file in folder.glob("*.safetensors"):
        file.unlink()
    from pegainfer.config.schema import EngineConfig, ModelConfig

    llm = LLM.from_config(
        EngineConfig(model=ModelConfig(path=str(folder), load_format="dummy"), device="cpu")
    )
    out = llm.generate(
        prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(max_tokens=4), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 4
