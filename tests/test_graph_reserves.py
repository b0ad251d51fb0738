"""The memory plan's reserve for the decode graphs against what their forwards keep, on the CPU through the
eager padded path (each bucket's static logits live as long as its graph). The GPU check of the captured
pools, workspaces included, is ``test_graph_capture_stays_within_its_reserves`` in the Qwen3.5 GPU tests."""

from __future__ import annotations

import pytest

from pegainfer import LLM
from pegainfer.errors import PluginError
from pegainfer.memory.rank_plan import GRAPH_SLACK, step_transients


def test_the_decode_graph_reserve_holds_every_buckets_logits(tiny_qwen3):
    llm = LLM(
        str(tiny_qwen3), dtype="float32", device="cpu", cpu_kv_cache_bytes=8 << 20, max_model_len=256,
        max_num_seqs=48,
    )  # fmt: skip
    runner, config = llm.engine.executor.runner, llm.engine.config
    runner.capture_cuda_graphs(eager=True)
    graphs = runner.graphs
    graphs.decode.seq_lens.fill_(1)  # as at capture: token 0 at page 0, no request live
    kept = sum(graphs._forward(size).nbytes for size in graphs.buckets)
    assert len(graphs.buckets) > 1 and kept > 48 * 4 * runner.model.vocab_size  # more than one bucket's
    (spec,) = [s for s in step_transients(runner.loaded, config, graphs=True) if s.role == "cuda_graphs"]
    assert spec.bytes_fixed - GRAPH_SLACK >= kept
    llm.engine.shutdown()


def test_prefill_graphs_without_a_hidden_size_name_the_model(tiny_qwen3, monkeypatch):
    """A model that runs prefill graphs must say how wide its hidden states are: the plan sizes the
    graphs' hidden-state outputs by it, and a 0 would reserve nothing for them."""
    llm = LLM(str(tiny_qwen3), dtype="float32", device="cpu", cpu_kv_cache_bytes=8 << 20, max_model_len=256)
    runner, config = llm.engine.executor.runner, llm.engine.config
    assert runner.model.prefill_graph_tokens > 0
    monkeypatch.setattr(type(runner.model), "hidden_size", property(lambda self: 0))
    with pytest.raises(PluginError, match=f"{type(runner.model).__name__} runs prefill graphs"):
        step_transients(runner.loaded, config, graphs=True)
    llm.engine.shutdown()


def test_only_mtp_drafting_reserves_draft_graphs(tiny_qwen3):
    """Prompt lookup drafts on the host: its plan reserves the verification rows (sampler, prefill graphs)
    but no MTP draft graphs, which its runner never captures."""
    llm = LLM(
        str(tiny_qwen3), dtype="float32", device="cpu", cpu_kv_cache_bytes=8 << 20, max_model_len=256,
        speculative_num_tokens=3, speculative_method="ngram",
    )  # fmt: skip
    runner, config = llm.engine.executor.runner, llm.engine.config
    roles = {s.role: s for s in step_transients(runner.loaded, config, graphs=True)}
    assert "draft_graphs" not in roles and "prefill_graphs" in roles
    plain = LLM(str(tiny_qwen3), dtype="float32", device="cpu", cpu_kv_cache_bytes=8 << 20, max_model_len=256)
    without = {
        s.role: s
        for s in step_transients(plain.engine.executor.runner.loaded, plain.engine.config, graphs=True)
    }
    assert roles["sampler"].bytes_per_seq > without["sampler"].bytes_per_seq  # rows for the drafts
    runner.capture_cuda_graphs(eager=True)
    assert runner.draft_graphs is None
    llm.engine.shutdown()
    plain.engine.shutdown()
