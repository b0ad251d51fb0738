"""Loading Qwen3.5 checkpoints: config layouts (VLM / text-only, new / legacy rope), layer_types, tied
embeddings, dtypes and shards, the skipped vision tower, the MTP module, and clear errors."""

from __future__ import annotations

import logging

import pytest
import torch

from pegainfer import LLM, SamplingParams
from pegainfer.errors import CheckpointError
from pegainfer.model.checkpoint import read_hf_config
from pegainfer.testing.checkpoints import write_tiny_checkpoint
from pegainfer.testing.conformance import hf_greedy, random_prompts, unused_checkpoint_tensors
from pegainfer_qwen35.config import Qwen35Config

PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.mark.parametrize(
    ("architecture", "options"),
    [
        ("qwen3_5", {"layout": "legacy"}),
        ("qwen3_5", {"text_only": True}),
        ("qwen3_5", {"tie_word_embeddings": True}),
        ("qwen3_5", {"dtype": "bfloat16", "num_shards": 2}),
        ("qwen3_5_moe", {"text_only": True, "layout": "legacy"}),
    ],
    ids=["legacy-rope", "text-only", "tied", "bf16-sharded", "moe-text-only-legacy"],
)
def test_checkpoint_variants_match_hf(tiny_checkpoint_factory, architecture, options):
    folder = tiny_checkpoint_factory(architecture, seed=7, **options)
    assert unused_checkpoint_tensors(folder) == []
    llm = LLM(str(folder), dtype="float32", device="cpu", cpu_kv_cache_bytes=4 << 20)
    prompts = random_prompts(5, [9, 21])
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(folder, prompts, 10)


def test_both_rope_layouts_and_nestings_parse_alike(tiny_checkpoint_factory):
    configs = [
        Qwen35Config.from_hf_config(read_hf_config(tiny_checkpoint_factory("qwen3_5", **options)))
        for options in (
            {},
            {"layout": "legacy"},
            {"text_only": True},
            {"text_only": True, "layout": "legacy"},
        )
    ]
    assert all(c == configs[0] for c in configs)
    c = configs[0]
    assert (c.rotary_dim, c.rope_theta, c.head_dim) == (16, 1e6, 32)  # partial_rotary_factor 0.5
    assert c.conv_dim == 2 * 2 * 16 + 4 * 24 and not c.is_moe


def test_layer_types_win_over_the_interval_rule(tiny_qwen35):
    hf_config = read_hf_config(tiny_qwen35)
    text = hf_config["text_config"]
    assert text["full_attention_interval"] == 3
    explicit = Qwen35Config.from_hf_config(hf_config)
    assert explicit.layer_types == tuple(text["layer_types"])
    assert explicit.layers_of("full_attention") == [1]  # the interval rule would say [2]
    no_list = {k: v for k, v in text.items() if k != "layer_types"}
    fallback = Qwen35Config.from_hf_config(no_list)
    assert fallback.layers_of("full_attention") == [2]
    # The partial rotary factor defaults to 0.25 when a config leaves it out.
    no_factor = {**no_list, "rope_parameters": {"rope_type": "default", "rope_theta": 1e7}}
    assert Qwen35Config.from_hf_config(no_factor).rotary_dim == text["head_dim"] // 4


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"layer_types": ["linear_attention", "sliding_attention", "full_attention", "linear_attention"]},
            "unknown layer_types",
        ),
        ({"layer_types": ["linear_attention"]}, "layer_types has 1 entries"),
        ({"linear_num_value_heads": 3}, "multiple of linear_num_key_heads"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6}}, "rope_type 'yarn'"),
    ],
)
def test_bad_configs_are_named(tiny_qwen35, change, message):
    hf_config = read_hf_config(tiny_qwen35)
    bad = {**hf_config, "text_config": {**hf_config["text_config"], **change}}
    with pytest.raises(CheckpointError, match=message):
        Qwen35Config.from_hf_config(bad)


def test_vision_tower_is_skipped_with_a_log_line_and_the_mtp_module_loaded(tiny_qwen35, caplog):
    with caplog.at_level(logging.INFO, logger="pegainfer_qwen35"):
        assert unused_checkpoint_tensors(tiny_qwen35) == []
    messages = [r.getMessage() for r in caplog.records]
    assert any("vision-tower tensors (model.visual.*)" in m for m in messages)
    assert not any("(mtp.*)" in m for m in messages)
    model = LLM(str(tiny_qwen35), device="cpu", speculative_num_tokens=1).engine.executor.runner.model
    assert model.num_mtp_layers == 1 and [s.layer_index for s in model.mtp_buffer_specs()] == [4]


def test_without_drafting_the_mtp_module_is_not_built(tiny_qwen35, caplog):
    """No memory for a draft module a run does not use: none is built, and its tensors are skipped with a
    log line instead of being reported unused."""
    from pegainfer.config.schema import EngineConfig, ModelConfig
    from pegainfer.model.checkpoint import CheckpointReader
    from pegainfer.model.model_loader import load_model

    model = load_model(EngineConfig(model=ModelConfig(path=str(tiny_qwen35)), device="cpu")).model
    assert model.num_mtp_layers == 0 and model.mtp_buffer_specs() == []
    reader = CheckpointReader(tiny_qwen35)
    with caplog.at_level(logging.INFO, logger="pegainfer_qwen35"):
        model.load_weights(reader)
    assert reader.unused() == []
    assert any("MTP tensors (mtp.*): drafting is off" in r.getMessage() for r in caplog.records)


def test_an_mtp_module_stripped_to_its_head_is_skipped(tmp_path, caplog):
    from safetensors.torch import load_file, save_file

    folder = write_tiny_checkpoint(tmp_path / "ckpt", "qwen3_5")
    tensors = load_file(str(folder / "model.safetensors"))
    save_file(
        {k: v for k, v in tensors.items() if not k.startswith("mtp.layers.")},
        str(folder / "model.safetensors"),
    )
    with caplog.at_level(logging.INFO, logger="pegainfer_qwen35"):
        assert unused_checkpoint_tensors(folder) == []
    messages = [r.getMessage() for r in caplog.records]
    assert any("no whole MTP module" in m for m in messages)
    assert any("4 MTP tensors (mtp.*)" in m for m in messages)


def test_missing_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = write_tiny_checkpoint(tmp_path / "ckpt", "qwen3_5")
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.language_model.layers.2.linear_attn.A_log"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.language_model\.layers\.2\.linear_attn\.A_log"):
        LLM(str(folder), device="cpu")


def test_buffer_specs_follow_layer_types(tiny_qwen35):
    from pegainfer.memory.buffer_specs import PagedKVSpec, RecurrentStateSpec

    llm = LLM(str(tiny_qwen35), dtype="float32", device="cpu", cpu_kv_cache_bytes=8 << 20)
    config = llm.engine.executor.runner.model.config
    specs = llm.engine.executor.runner.model.buffer_specs()
    for spec, kind in zip(specs, config.layer_types, strict=True):
        assert isinstance(spec, PagedKVSpec if kind == "full_attention" else RecurrentStateSpec)
    engine = llm.engine
    assert set(engine.executor.runner.buffers.caches) == set(config.layers_of("full_attention"))
    assert set(engine.executor.runner.buffers.states) == set(config.layers_of("linear_attention"))
    ssm = engine.executor.runner.buffers.states[0]["ssm"]
    assert ssm.dtype == torch.float32 and ssm.shape[1:] == (4, 16, 24)
    assert engine.executor.plan.num_state_slots == engine.config.scheduler.max_num_seqs
