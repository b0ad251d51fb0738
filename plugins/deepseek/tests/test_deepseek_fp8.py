"""Block-FP8 checkpoints (DeepSeek's release format) load and dequantize correctly on the reference path.

The checkpoint is wide enough that projections span several 128×128 blocks, with partial edge blocks in
both directions. Its dequantized weights must equal a block-by-block hand computation, and the model
must generate exactly what the same model generates from the dequantized weights stored in float32.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from pegainfer import LLM, SamplingParams
from pegainfer.config.compose import build_engine_config, compose
from pegainfer.errors import CheckpointError
from pegainfer.testing.conformance import (
    conformance_engine,
    hf_greedy,
    teacher_forced_errors,
    unused_checkpoint_tensors,
)
from pegainfer_deepseek.tiny import UNALIGNED_SHAPE, write_fp8_copy

PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def folders(tiny_checkpoint_factory, tmp_path_factory):
    source = tiny_checkpoint_factory("deepseek_v3", seed=5, **UNALIGNED_SHAPE)
    root = tmp_path_factory.mktemp("fp8")
    return write_fp8_copy(source, root / "fp8"), write_fp8_copy(
        source, root / "dequantized", dequantized=True
    )


@pytest.fixture(scope="module")
def fp8_llm(folders):
    """16-bit activations (W8A16): the model whose outputs must equal the dequantized checkpoint's.
    Drafting on, so the MTP layer is built and loaded (its dequantized weights are checked too)."""
    return conformance_engine(
        "deepseek", folders[0], "model.fp8_activations=false", "speculative.num_tokens=1"
    )


def _hand_dequantize(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=torch.float32)
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            rows, cols = slice(128 * i, 128 * (i + 1)), slice(128 * j, 128 * (j + 1))
            out[rows, cols] = q[rows, cols].float() * scale_inv[i, j]
    return out


def test_checkpoint_is_in_deepseeks_fp8_layout(folders):
    fp8 = folders[0]
    config = json.loads((fp8 / "config.json").read_text())
    assert config["quantization_config"] == {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    }
    with safe_open(str(fp8 / "model.safetensors"), framework="pt") as f:
        w = f.get_tensor("model.layers.0.mlp.gate_proj.weight")
        s = f.get_tensor("model.layers.0.mlp.gate_proj.weight_scale_inv")
        assert (w.dtype, tuple(w.shape), s.dtype, tuple(s.shape)) == (
            torch.float8_e4m3fn,
            (288, 160),
            torch.float32,
            (3, 2),
        )
        assert (
            f.get_tensor("model.layers.1.mlp.gate.weight").dtype == torch.float32
        )  # the router stays unquantized
        assert "model.layers.2.eh_proj.weight_scale_inv" not in f.keys()  # so does the MTP projection


def test_every_tensor_and_scale_is_consumed(folders):
    assert unused_checkpoint_tensors(folders[0]) == []


@pytest.mark.parametrize(
    "name, loaded",
    [
        (  # projections stay float8 with per-row tile scales, gate and up rows interleaved
            "model.layers.0.mlp.gate_proj.weight",
            lambda m: m.layers[0].mlp.gate_up_proj.dequantize(torch.float32)[0::2],
        ),
        (
            "model.layers.1.self_attn.q_a_proj.weight",
            lambda m: m.layers[1].self_attn.in_proj.dequantize(torch.float32)[: m.layers[1].self_attn.q_rows],
        ),
        (
            "model.layers.1.self_attn.kv_a_proj_with_mqa.weight",
            lambda m: m.layers[1].self_attn.in_proj.dequantize(torch.float32)[m.layers[1].self_attn.q_rows :],
        ),
        ("model.layers.0.self_attn.kv_b_proj.weight", lambda m: m.layers[0].self_attn.kv_b_proj),
        (
            "model.layers.1.self_attn.q_b_proj.weight",
            lambda m: m.layers[1].self_attn.q_b_proj.dequantize(torch.float32),
        ),
        (  # the routed experts stay float8: dequantized through their tile scales where used
            "model.layers.1.mlp.experts.5.down_proj.weight",
            lambda m: (
                m.layers[1]
                .mlp._scales()
                .dequantize(
                    5, m.layers[1].mlp.experts_gate_up[5], m.layers[1].mlp.experts_down[5], torch.float32
                )[1]
            ),
        ),
        (
            "model.layers.1.mlp.experts.3.up_proj.weight",
            lambda m: (
                m.layers[1]
                .mlp._scales()
                .dequantize(
                    3, m.layers[1].mlp.experts_gate_up[3], m.layers[1].mlp.experts_down[3], torch.float32
                )[0][48:]
            ),
        ),
        (
            "model.layers.1.mlp.shared_experts.up_proj.weight",
            lambda m: m.layers[1].mlp.shared_experts.gate_up_proj.dequantize(torch.float32)[1::2],
        ),
        (
            "model.layers.2.self_attn.o_proj.weight",
            lambda m: m.mtp[0].block.self_attn.o_proj.dequantize(torch.float32),
        ),
    ],
)
def test_dequantized_weights_equal_hand_reference(fp8_llm, folders, name, loaded):
    with safe_open(str(folders[0] / "model.safetensors"), framework="pt") as f:
        expected = _hand_dequantize(f.get_tensor(name), f.get_tensor(name + "_scale_inv"))
    assert torch.equal(loaded(fp8_llm.engine.executor.runner.model), expected)


def test_experts_and_projections_stay_float8_in_memory(fp8_llm, folders):
    """Most of DeepSeek's bytes are its routed experts: kept as stored (float8 and the tile scales), they
    take a quarter of their float32 size here (half of bf16's on a GPU). So do the projections, as stored
    with each row given its tile row's scales."""
    model = fp8_llm.engine.executor.runner.model
    moe = model.layers[1].mlp
    assert moe.experts_gate_up.dtype == moe.experts_down.dtype == torch.float8_e4m3fn
    with safe_open(str(folders[0] / "model.safetensors"), framework="pt") as f:
        assert torch.equal(
            moe.experts_down[2].view(torch.uint8),
            f.get_tensor("model.layers.1.mlp.experts.2.down_proj.weight").view(torch.uint8),
        )
        assert torch.equal(
            moe.experts_gate_up_scale[2, 0],
            f.get_tensor("model.layers.1.mlp.experts.2.gate_proj.weight_scale_inv"),
        )
        o_proj = model.layers[1].self_attn.o_proj
        assert torch.equal(
            o_proj.weight.view(torch.uint8),
            f.get_tensor("model.layers.1.self_attn.o_proj.weight").view(torch.uint8),
        )
        tiles = f.get_tensor("model.layers.1.self_attn.o_proj.weight_scale_inv")
        assert torch.equal(o_proj.scale, tiles.repeat_interleave(128, dim=0)[: o_proj.shape[0]])
    assert model.layers[0].mlp.gate_up_proj.weight.dtype == torch.float8_e4m3fn
    assert model.layers[1].self_attn.kv_b_proj.dtype == torch.float32  # dequantized at load
    # Settled at load: a tile's 128 rows share their scales, gate and up rows (interleaved) alternately.
    assert o_proj.scale_groups == (128, 1)
    assert model.layers[0].mlp.gate_up_proj.scale_groups == (128, 2)


def test_greedy_equals_the_dequantized_model(fp8_llm, folders):
    rng = random.Random(3)
    prompts = [[rng.randrange(990) for _ in range(n)] for n in (7, 19, 30)]
    fp8 = [
        o.outputs[0].token_ids
        for o in fp8_llm.generate(prompt_token_ids=prompts, sampling_params=PARAMS, use_tqdm=False)
    ]
    dense_llm = LLM(str(folders[1]), dtype="float32", device="cpu", cpu_kv_cache_bytes=4 << 20)
    dense = [
        o.outputs[0].token_ids
        for o in dense_llm.generate(prompt_token_ids=prompts, sampling_params=PARAMS, use_tqdm=False)
    ]
    assert fp8 == dense
    assert dense == hf_greedy(folders[1], prompts, 16)


def test_fp8_activations_cost_a_stated_error(folders):
    """W8A8 (``model.fp8_activations=true``, the checkpoint's ``activation_scheme: dynamic``): every GEMM's input
    (projections and routed experts) is quantized per token and 128 columns. Teacher-forced logits
    against transformers on the dequantized weights (relative L2): W8A16 at ~2e-6 (``test_greedy_equals_
    the_dequantized_model``), W8A8 at 0.153 / 0.125 (prefill / decode) on this checkpoint (0.150 / 0.123
    with the experts' activations 16-bit): e4m3's 3 mantissa bits on every GEMM's input, in a random
    2-layer model with no residual stream to dominate the noise, as in ``test_quantization_fp8_quantizes_
    a_plain_checkpoint``."""
    w8a8 = conformance_engine("deepseek", folders[0], "model.fp8_activations=true")
    attention = w8a8.engine.executor.runner.model.layers[1].self_attn
    assert attention.o_proj.fp8_activations and attention.in_proj.fp8_activations
    assert w8a8.engine.executor.runner.model.layers[1].mlp._scales().fp8_activations
    prefill, decode = teacher_forced_errors(w8a8, folders[1])
    assert 1e-3 < prefill < 0.25 and 1e-3 < decode < 0.25, (prefill, decode)


def test_memory_plan_reserves_what_each_fp8_form_allocates(fp8_llm, folders):
    """W8A16's prefill widens its largest projection into a scratch in the compute dtype; W8A8 never
    does, and instead holds a token's widest GEMM input quantized (a byte a value, 4 per 128 for scales)."""
    from pegainfer.layers.block_fp8 import widened_bytes

    model = fp8_llm.engine.executor.runner.model
    w8a16 = {t.role: t for t in model.transient_specs()}
    assert w8a16["deepseek_fp8_widened_weight"].bytes_fixed == widened_bytes(model, model.dtype) > 0
    assert "deepseek_fp8_activations" not in w8a16
    w8a8_model = conformance_engine(
        "deepseek", folders[0], "model.fp8_activations=true"
    ).engine.executor.runner.model
    w8a8 = {t.role: t for t in w8a8_model.transient_specs()}
    d = w8a8_model.dims
    widest = max(d.hidden_size, d.q_lora_rank, d.num_heads * d.v_head_dim, d.intermediate_size)
    assert "deepseek_fp8_widened_weight" not in w8a8
    assert w8a8["deepseek_fp8_activations"].bytes_per_token == widest + widest // 32


def test_static_activation_scales_are_refused(folders, tmp_path):
    broken = Path(shutil.copytree(folders[0], tmp_path / "static"))
    config = json.loads((broken / "config.json").read_text())
    config["quantization_config"]["activation_scheme"] = "static"
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="activation_scheme 'static' is not supported"):
        LLM(str(broken), dtype="float32", device="cpu")


def test_scales_without_quantization_config_are_refused(folders, tmp_path):
    broken = Path(shutil.copytree(folders[0], tmp_path / "broken"))
    config = json.loads((broken / "config.json").read_text())
    del config["quantization_config"]
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        CheckpointError, match="weight_scale_inv' is in the checkpoint but config.json has no FP8"
    ):
        LLM(str(broken), dtype="float32", device="cpu")


def test_dummy_weights_fill_the_float8_experts(folders):
    """``load_format=dummy`` (the benchmarks' random weights) draws float8 experts through float32."""
    config = build_engine_config(
        compose("generate", [f"model.path={folders[0]}", "model.load_format=dummy", "model.dtype=float32",
                             "device=cpu", f"cache.cpu_kv_cache_bytes={4 << 20}"])
    )  # fmt: skip
    llm = LLM.from_config(config)
    model = llm.engine.executor.runner.model
    moe = model.layers[1].mlp
    assert moe.experts_gate_up.dtype == torch.float8_e4m3fn
    assert moe.experts_gate_up.float().std() > 0 and moe.experts_down_scale.float().std() > 0
    o_proj = model.layers[1].self_attn.o_proj  # its rows share scales in tiles, as a checkpoint's do
    assert o_proj.scale_groups == (128, 1) and o_proj.scale.float().std() > 0
    out = llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=PARAMS, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == PARAMS.max_tokens


def test_quantization_fp8_quantizes_a_plain_checkpoint(tiny_checkpoint_factory):
    """``model.quantization=fp8`` on a float32 checkpoint: the routed experts and the projections become
    block FP8 (128×128 tiles, each tile's largest magnitude at 448) at load, as DeepSeek quantizes its
    releases; norms, router, embeddings, kv_b_proj stay as they are. The accuracy cost, teacher-forced
    logits against transformers on the unquantized weights (relative L2), is measured here: the
    unquantized model is at 1.9e-6 / 2.2e-6 (prefill / decode), the quantized one at 0.153 / 0.180 on this
    checkpoint (0.033 / 0.039 with only the experts quantized): e4m3 keeps 3 mantissa bits (~3.6% rms
    error a weight), and a random 3-layer model has no residual stream to dominate the eight quantized
    projections' noise, as a trained one does. (Activations 16-bit here: the weights' cost alone.)"""
    from pegainfer_deepseek.fp8 import quantize_blocks

    source = tiny_checkpoint_factory("deepseek_v3", seed=5, **UNALIGNED_SHAPE)
    plain = conformance_engine("deepseek", source)
    quantized = conformance_engine(
        "deepseek", source, "model.quantization=fp8", "model.fp8_activations=false"
    )
    moe = quantized.engine.executor.runner.model.layers[1].mlp
    assert moe.experts_down.dtype == torch.float8_e4m3fn and moe.scale_offset == 0
    with safe_open(str(source / "model.safetensors"), framework="pt") as f:
        q, scale = quantize_blocks(f.get_tensor("model.layers.1.mlp.experts.4.down_proj.weight"), (128, 128))
        o_weight = f.get_tensor("model.layers.1.self_attn.o_proj.weight")
    assert torch.equal(moe.experts_down[4].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(moe.experts_down_scale[4], scale)
    o_proj = quantized.engine.executor.runner.model.layers[1].self_attn.o_proj
    q, tiles = quantize_blocks(o_weight, (128, 128))
    assert torch.equal(o_proj.weight.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(o_proj.scale, tiles.repeat_interleave(128, dim=0)[: q.shape[0]])
    assert plain.engine.executor.runner.model.layers[1].mlp.experts_down.dtype == torch.float32
    assert max(teacher_forced_errors(plain, source)) < 1e-4
    prefill, decode = teacher_forced_errors(quantized, source)
    assert 1e-4 < prefill < 0.25 and 1e-4 < decode < 0.25, (prefill, decode)


def test_quantization_key_is_validated(tiny_checkpoint_factory):
    from pegainfer.errors import ConfigError

    with pytest.raises(ConfigError, match="quantization"):
        conformance_engine("deepseek", tiny_checkpoint_factory("deepseek_v3"), "model.quantization=int4")


def test_an_expert_left_unquantized_is_quantized_at_load(folders, tmp_path):
    """An FP8 checkpoint whose expert 2 of layer 1 is stored plain (its scales dropped): that expert is
    quantized at load on the same tiles. Its weights sit on the FP8 grid already, so the model still
    generates exactly what the dequantized model does."""
    from safetensors.torch import load_file, save_file

    folder = Path(shutil.copytree(folders[0], tmp_path / "mixed"))
    tensors = load_file(str(folder / "model.safetensors"))
    for proj in ("gate_proj", "up_proj", "down_proj"):
        name = f"model.layers.1.mlp.experts.2.{proj}.weight"
        tensors[name] = _hand_dequantize(tensors[name], tensors.pop(name + "_scale_inv"))
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    mixed = conformance_engine("deepseek", folder, "model.fp8_activations=false")
    moe = mixed.engine.executor.runner.model.layers[1].mlp
    assert moe.experts_down.dtype == torch.float8_e4m3fn
    rng = random.Random(3)
    prompts = [[rng.randrange(990) for _ in range(n)] for n in (7, 19)]
    dense = LLM(str(folders[1]), dtype="float32", device="cpu", cpu_kv_cache_bytes=4 << 20)

    def run(llm):
        return [
            o.outputs[0].token_ids
            for o in llm.generate(prompt_token_ids=prompts, sampling_params=PARAMS, use_tqdm=False)
        ]

    assert run(mixed) == run(dense)
