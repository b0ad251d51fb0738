"""Qwen3 over two tensor-parallel ranks (gloo, CPU, float32): the same tokens as transformers and as one
rank, untied and tied embeddings, with the async decode-graph path and preemption."""

from __future__ import annotations

import pytest

from pegainfer.testing.checkpoints import write_tiny_checkpoint
from pegainfer.testing.conformance import assert_tensor_parallel_matches

pytestmark = pytest.mark.slow


def test_tied_with_fewer_kv_heads_than_ranks(tmp_path):
    # 4 query heads and 1 key/value head over 2 ranks: the kv head is replicated on both; a vocabulary the
    # ranks do not divide (the last rank's rows are zero padding).
    folder = write_tiny_checkpoint(
        tmp_path / "tied",
        "qwen3",
        tie_word_embeddings=True,
        num_key_value_heads=1,
        attention_bias=True,
        vocab_size=1001,
    )
    assert_tensor_parallel_matches(folder)
