"""Qwen3.5 over two tensor-parallel ranks (gloo, CPU, float32): the same tokens as transformers and as one
rank, dense and MoE, with the async decode-graph path, chunked prefill and preemption (the GDN slot states
and the paged KV cache are the ranks' own shards)."""

from __future__ import annotations

import pytest

from pegainfer.testing.conformance import assert_tensor_parallel_matches

pytestmark = pytest.mark.slow


def test_tied_with_fewer_kv_heads_than_ranks(tiny_checkpoint_factory):
    # One full-attention kv head, replicated on both ranks; tied embeddings over a vocabulary the ranks do
    # not divide (the last rank's rows are zero padding).
    folder = tiny_checkpoint_factory(
        "qwen3_5", num_key_value_heads=1, tie_word_embeddings=True, vocab_size=1001, seed=3
    )
    assert_tensor_parallel_matches(folder, async_scheduling=True)
