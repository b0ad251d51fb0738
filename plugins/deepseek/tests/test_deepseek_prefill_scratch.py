"""The memory plan's bound on the expanded prefill attention (MLA's keys and values over a whole context,
one query block through SDPA's math path, as the GPU runs it) and on V3.2's indexer selection: what one
long segment allocates, measured on the CPU allocator in bf16, stays within the bound and not far below
it, and the plan reserves the bound at ``max_model_len``."""

from __future__ import annotations

import random

import pytest
from torch.nn.attention import SDPBackend, sdpa_kernel

from pegainfer import LLM, SamplingParams
from pegainfer.layers import attention
from pegainfer.testing.cpu_peak import peak_cpu_bytes
from pegainfer_deepseek import indexer, mla
from pegainfer_deepseek.indexer import LightningIndexer
from pegainfer_deepseek.mla import MLAttention

CONTEXT = 600  # three query blocks


@pytest.mark.parametrize("block_context", [4096, 150], ids=["whole-blocks", "shrunk-blocks"])
@pytest.mark.parametrize("architecture", ["deepseek_v3", "deepseek_v32"], ids=["v3", "v32"])
def test_prefill_attention_stays_within_its_scratch_bound(
    architecture, block_context, tiny_checkpoint_factory, monkeypatch
):
    """Past ``BLOCK_CONTEXT`` keys (150 here) a block takes fewer queries (64 of 256 over 599 keys)."""
    monkeypatch.setattr(attention, "BLOCK_CONTEXT", block_context)
    llm = LLM(
        str(tiny_checkpoint_factory(architecture)), dtype="bfloat16", device="cpu", max_model_len=CONTEXT,
        max_num_batched_tokens=CONTEXT, cpu_kv_cache_bytes=16 << 20, enable_prefix_caching=False,
    )  # fmt: skip
    model = llm.engine.executor.runner.model
    dims = model.dims
    measured: dict[str, list[tuple[int, int, int]]] = {"mla": [], "indexer": []}

    def measuring(kind, original):
        def run(self, *args, **kwargs):
            meta = next(a for a in args if hasattr(a, "prefills"))
            result, peak = peak_cpu_bytes(lambda: original(self, *args, **kwargs))
            (seg,) = meta.prefills
            measured[kind].append((seg.ctx_len, seg.q_len, peak))
            return result

        return run

    monkeypatch.setattr(MLAttention, "_prefill", measuring("mla", MLAttention._prefill))
    monkeypatch.setattr(LightningIndexer, "_prefill", measuring("indexer", LightningIndexer._prefill))
    prompt = random.Random(0).choices(range(100), k=CONTEXT - 1)
    with sdpa_kernel(SDPBackend.MATH):  # the GPU's path for these shapes: scores materialised
        llm.generate(
            prompt_token_ids=[prompt],
            sampling_params=SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
            use_tqdm=False,
        )
    heads = model.layers[0].self_attn.num_heads
    assert len(measured["mla"]) == len(model.layers)
    for ctx, _, peak in measured["mla"]:
        assert ctx == CONTEXT - 1
        bound = mla.prefill_scratch_bytes(dims, heads, ctx, 2)
        assert bound / 2 <= peak <= bound, (peak, bound)
    if dims.indexer is not None:
        assert len(measured["indexer"]) == len(model.layers)
        for ctx, q_len, peak in measured["indexer"]:
            selections = q_len * ctx  # returned, counted per token by the plan
            bound = indexer.prefill_scratch_bytes(dims, ctx, 2)
            assert bound / 2 <= peak - selections <= bound, (peak, bound)
    # The plan reserves the larger of the two at max_model_len, once.
    plan = llm.engine.executor.plan
    reserve = max(
        mla.prefill_scratch_bytes(dims, heads, CONTEXT, 2),
        indexer.prefill_scratch_bytes(dims, CONTEXT, 2) if dims.indexer is not None else 0,
    )
    assert plan.transients["deepseek_prefill_attention"] == reserve
