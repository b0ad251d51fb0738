"""The decode floors of the benchmark scripts (``bench/qwen35.py``, ``bench/deepseek.py``) on tiny CPU
engines. ``bandwidth_utilization`` is a floor over a measured step, so a floor that reads an engine
contract wrongly (a router's outputs, a scale layout) gives a wrong figure without failing anything on
the GPU: the experts a step chooses must come from the routers' ids, one count per MoE layer, and a
block-FP8 weight's scales count once per group of rows that share them, as the kernels load them.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

from pegainfer import LLM, SamplingParams
from pegainfer.layers.block_fp8 import BlockFP8Weight
from pegainfer.model.model_loader import parameter_bytes
from pegainfer.testing.conformance import random_prompts
from pegainfer.testing.speculative import generate

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="module")
def bench():
    """The bench scripts as modules (they import their ``common`` from their own folder)."""
    sys.path.insert(0, str(BENCH))
    try:
        yield lambda name: importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))


def _one_token_step(llm: LLM):
    """A step of one token: every MoE layer routes one row, which chooses exactly k experts."""
    return lambda: generate(llm, random_prompts(3, [1]), SamplingParams(temperature=0, max_tokens=1))


def test_qwen35_floor_counts_the_chosen_experts(bench, tiny_checkpoint_factory) -> None:
    from pegainfer_qwen35.moe import SparseMoE

    qwen35 = bench("qwen35")
    llm = LLM(str(tiny_checkpoint_factory("qwen3_5_moe")), dtype="float32", device="cpu")
    model = llm.engine.executor.runner.model
    c = model.config
    moes = [m for m in model.modules() if isinstance(m, SparseMoE)]
    seen = qwen35.distinct_experts(llm, _one_token_step(llm))
    assert moes and seen == [c.num_experts_per_tok] * len(moes)

    ctx = 10
    floor = qwen35.step_bytes(model, 1, ctx, seen)
    unchosen = sum(
        (c.num_experts - c.num_experts_per_tok) * (m.experts_gate_up[0].nbytes + m.experts_down[0].nbytes)
        for m in moes
    )
    table = model.embed_tokens
    kv = len(c.layers_of("full_attention")) * ctx * 2 * c.num_kv_heads * c.head_dim * 4  # float32 cache
    state = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim
    recurrent = len(c.layers_of("linear_attention")) * 2 * 4 * (state + c.conv_dim * (c.conv_kernel - 1))
    weights = parameter_bytes(model) - unchosen - table.nbytes + table[0].nbytes
    # The bench counts KV in bf16 (its runs' dtype): a float32 engine's cache is twice that.
    assert floor == pytest.approx(weights + kv / 2 + recurrent)


def test_qwen35_expert_count_refuses_a_route_without_ids(bench, tiny_checkpoint_factory, monkeypatch) -> None:
    from pegainfer_qwen35.moe import SparseMoE

    qwen35 = bench("qwen35")
    llm = LLM(str(tiny_checkpoint_factory("qwen3_5_moe")), dtype="float32", device="cpu")
    route = SparseMoE.route
    monkeypatch.setattr(SparseMoE, "route", lambda self, *a, **kw: route(self, *a, **kw)[::-1])
    with pytest.raises(RuntimeError, match="int64 expert ids"):
        qwen35.distinct_experts(llm, _one_token_step(llm))


def test_deepseek_fp8_floor_reads_the_checkpoints_scales_once(
    bench, tiny_checkpoint_factory, tmp_path_factory
) -> None:
    from safetensors import safe_open

    from pegainfer_deepseek.moe import MoE
    from pegainfer_deepseek.tiny import write_fp8_copy

    deepseek = bench("deepseek")
    source = tiny_checkpoint_factory("deepseek_v3", seed=5)
    folder = write_fp8_copy(source, tmp_path_factory.mktemp("fp8") / "ckpt")
    llm = LLM(str(folder), device="cpu")
    model = llm.engine.executor.runner.model
    kept = sum(m.scale.nbytes for m in model.modules() if isinstance(m, BlockFP8Weight))
    # The projections that stay float8 (kv_b is dequantized at load, the experts keep tile scales).
    mtp = f"model.layers.{json.loads((Path(folder) / 'config.json').read_text())['num_hidden_layers']}."
    scales = 0
    for path in Path(folder).glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            for name in f.keys():
                if name.endswith("weight_scale_inv") and ".experts." not in name and "kv_b_proj" not in name:
                    if not name.startswith(mtp):  # the MTP layer: not built without drafting
                        scales += f.get_tensor(name).nbytes
    assert 0 < scales < kept
    assert kept - deepseek.unread_scale_bytes(model) == scales

    moes = [m for m in model.modules() if isinstance(m, MoE)]
    seen = deepseek.distinct_experts(llm, _one_token_step(llm))
    assert seen == [moes[0].gate.rule.k] * len(moes)
