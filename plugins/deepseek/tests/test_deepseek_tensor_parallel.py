"""DeepSeek-V3 and V3.2 over two tensor-parallel ranks (gloo, CPU, float32): the same tokens as
transformers and as one rank (single, batched, logprobs, seeded sampling, chunked prefill with
preemption), V3 drafting with its MTP layer (random drafts, and an aligned MTP layer whose drafts are
accepted: still the non-speculative greedy output), a block-FP8 checkpoint whose shard boundaries fall
inside its 128x128 scale blocks (16-bit activations) and one whose shards are tile-aligned (W8A8), and
DeepSeek-V4's refusal through the engine. Async scheduling is not
available for these models (they do not embed on the device).

What each rank holds is checked without engines in ``test_deepseek_tp_sharding.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pegainfer import LLM, SamplingParams
from pegainfer.errors import ConfigError
from pegainfer.testing.conformance import assert_tensor_parallel_matches, random_prompts
from pegainfer_deepseek.tiny import write_fp8_copy

pytestmark = pytest.mark.slow


def _llm(folder: Path, tp: int, k: int = 0) -> LLM:
    return LLM(
        str(folder),
        dtype="float32",
        device="cpu",
        cpu_kv_cache_bytes=8 << 20,
        tensor_parallel_size=tp,
        speculative_num_tokens=k,
    )


def _steps(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[list[list[int]], dict]:
    before = dict(llm.engine.stats)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], {k: v - before[k] for k, v in llm.engine.stats.items()}


def test_v32_matches_transformers_and_one_rank(tiny_checkpoint_factory) -> None:
    # A vocabulary the ranks do not divide: the last rank's embedding and lm_head rows are padding.
    assert_tensor_parallel_matches(tiny_checkpoint_factory("deepseek_v32", vocab_size=1001))


def test_accepted_mtp_drafts_give_the_non_speculative_output(aligned_deepseek: Path) -> None:
    """With drafts that are mostly right, two ranks drafting give one rank's greedy tokens without
    drafting, accept as many drafts as one rank drafting does (the draft logits are gathered, so both
    ranks draft the same tokens), and take fewer steps."""
    prompts = random_prompts(5, [5, 17, 3, 30])
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ref, ref_stats = _steps(_llm(aligned_deepseek, 1), prompts, params)
    one_tokens, one_stats = _steps(_llm(aligned_deepseek, 1, k=2), prompts, params)
    llm = _llm(aligned_deepseek, 2, k=2)
    try:
        tokens, stats = _steps(llm, prompts, params)
        llm.engine.buffers.check_invariants()
    finally:
        llm.engine.shutdown()
    assert tokens == one_tokens == ref
    assert stats["spec_accepted_tokens"] / stats["spec_draft_tokens"] > 0.25
    assert stats["steps"] < ref_stats["steps"] - 3
    assert (stats["spec_draft_tokens"], stats["spec_accepted_tokens"]) == (
        one_stats["spec_draft_tokens"],
        one_stats["spec_accepted_tokens"],
    )


def _fp8_engine(folder: Path, tp: int, *overrides: str) -> LLM:
    from pegainfer.config.compose import build_engine_config, compose

    args = [
        "model=deepseek",
        f"model.path={folder}",
        "model.dtype=float32",
        "device=cpu",
        f"cache.cpu_kv_cache_bytes={8 << 20}",
    ]
    return LLM.from_config(build_engine_config(compose("generate", [*args, f"tp={tp}", *overrides])))


@pytest.mark.parametrize(
    ("shape", "overrides"),
    [
        # 4 heads, 288 dense and 48 expert features: each rank's rows and columns start inside a 128x128
        # scale block (q_b_proj rows 64, kv_b_proj rows 80, o_proj columns 48, experts 24, dense 144).
        # 16-bit activations: W8A8 quantizes a rank's part of a tile as its own group, which one rank
        # does not, so only W8A16 is the same model there.
        ({"intermediate_size": 288, "moe_intermediate_size": 48}, ["model.fp8_activations=false"]),
        # W8A8 where the row-parallel inputs split on tile boundaries (o_proj 128 columns a rank, dense
        # down 128, the experts' down 128, shared down 256): each rank's activation groups are one rank's.
        (
            {"intermediate_size": 256, "moe_intermediate_size": 256, "v_head_dim": 64},
            ["model.fp8_activations=true"],
        ),
    ],
    ids=["w8a16-unaligned", "w8a8-aligned"],
)
def test_fp8_checkpoint_gives_one_ranks_tokens(
    tiny_checkpoint_factory, tmp_path: Path, shape, overrides
) -> None:
    source = tiny_checkpoint_factory(
        "deepseek_v3",
        seed=5,
        hidden_size=160,
        q_lora_rank=144,
        kv_lora_rank=136,
        num_hidden_layers=2,
        **shape,
    )
    folder = write_fp8_copy(source, tmp_path / "fp8")
    prompts = random_prompts(3, [7, 19, 30])
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    one_llm = _fp8_engine(folder, 1, *overrides)
    one, _ = _steps(one_llm, prompts, params)
    act8 = overrides == ["model.fp8_activations=true"]
    assert one_llm.engine.executor.runner.model.layers[0].mlp.down_proj.fp8_activations == act8
    if act8:  # the activations' rounding shows in the tokens: a run that ignored the key would not differ
        assert _steps(_fp8_engine(folder, 1, "model.fp8_activations=false"), prompts, params)[0] != one
    llm = _fp8_engine(folder, 2, *overrides)
    try:
        assert _steps(llm, prompts, params)[0] == one
    finally:
        llm.engine.shutdown()


def test_v4_is_refused_by_a_two_rank_engine(tiny_checkpoint_factory) -> None:
    with pytest.raises(ConfigError, match="DeepSeek-V4 does not support tensor parallelism yet"):
        _llm(tiny_checkpoint_factory("deepseek_v4"), 2)
