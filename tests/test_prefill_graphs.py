"""The CUDA-graph prefill path: its buckets, its persistent inputs (padding that reads and writes nothing)
and, on the CPU, its eager form (the same padded forward) against the plain path.

The conformance suite runs it over prefix-cache hits for every plugin (``test_prefix_caching_on_the_graph_
paths``); on a GPU, graph replay against ``enforce_eager`` is checked by the plugins' GPU tests.
"""

from __future__ import annotations

import random

import pytest
import torch

from pegainfer import LLM, SamplingParams
from pegainfer.layers.attention import (
    AttentionMetadata,
    padding_as_first_row,
    paged_attention_reference,
    prefill_graph_rows,
)
from pegainfer.memory.prefill_graph_inputs import (
    MAX_SEGMENTS,
    PrefillGraphInputs,
    prefill_graph_buckets,
    prefill_graph_inputs_bytes,
    prefill_graph_shape,
)


def test_buckets_double_up_to_the_largest():
    assert prefill_graph_buckets(128) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert prefill_graph_buckets(100) == [1, 2, 4, 8, 16, 32, 64, 100]
    assert prefill_graph_buckets(2) == [1, 2]
    assert prefill_graph_buckets(1) == [1]
    assert prefill_graph_buckets(0) == []


def test_shape_is_bounded_by_the_model_the_cap_and_the_budget():
    assert prefill_graph_shape(128, 256, 4096, 128) == (128, MAX_SEGMENTS)
    assert prefill_graph_shape(10**9, 64, 4096, 4) == (64, 4)
    assert prefill_graph_shape(128, 128, 12, 8) == (12, 8)
    assert prefill_graph_shape(0, 128, 4096, 128) == (0, 0)
    assert prefill_graph_shape(128, 0, 4096, 128) == (0, 0)


def test_inputs_hold_the_step_and_pad_the_rest():
    inp = PrefillGraphInputs(max_tokens=16, max_segments=4, max_blocks_per_seq=5, device=torch.device("cpu"))
    # Block size 4: a 3-token chunk at positions 5..7 (pages 9, 2), a 2-token one at 0..1 (page 6).
    written = inp.prepare(
        [([11, 12, 13], 5, [9, 2, 7]), ([21, 22], 0, [6])], [3, 1], [(-1, -1, 0), (1, 4, 2)], 4
    )
    assert written == 5
    assert inp.input_ids.tolist() == [11, 12, 13, 21, 22] + [0] * 11
    assert inp.positions.tolist()[:5] == [5, 6, 7, 0, 1]
    assert inp.slot_mapping.tolist() == [2 * 4 + 1, 2 * 4 + 2, 2 * 4 + 3, 6 * 4, 6 * 4 + 1] + [-1] * 11
    assert inp.cu_seqlens.tolist() == [0, 3, 5, 5, 5]
    assert (inp.q_start.tolist(), inp.q_len.tolist(), inp.ctx_len.tolist()) == (
        [0, 3, 5, 5],
        [3, 2, 0, 0],
        [8, 2, 0, 0],
    )
    assert inp.block_tables[0, :2].tolist() == [9, 2] and inp.block_tables[1, 0].item() == 6
    assert inp.state_slots.tolist() == [3, 1, -1, -1]
    assert inp.checkpoint_tokens.tolist() == [-1, 1, -1, -1]
    assert inp.checkpoint_slots.tolist()[1] == 4 and inp.checkpoint_counts.tolist() == [0, 2, 0, 0]
    assert inp.logit_rows.tolist() == [2, 4, 0, 0]
    # The next step starts from a clean slate: nothing of the last one is left as a live segment.
    inp.prepare([([5] * 4, 0, [1])], None, None, 4)
    assert inp.q_len.tolist() == [4, 0, 0, 0] and inp.state_slots.tolist() == [0, -1, -1, -1]
    assert inp.checkpoint_tokens.tolist() == [-1] * 4 and inp.slot_mapping.tolist()[4:] == [-1] * 12
    inp.clear()
    assert inp.q_len.tolist() == [0] * 4 and inp.slot_mapping.tolist() == [-1] * 16


def test_segments_sample_up_to_rows_per_segment_listed_from_the_front():
    """A verification chunk samples its known token and its drafts, a mid-prompt chunk nothing, a prompt's
    last chunk its last row: the rows in segment order, then padding."""
    inp = PrefillGraphInputs(16, 4, 5, torch.device("cpu"), rows_per_segment=3)
    chunks = [([1, 2, 3], 9, [0, 1, 2]), ([4, 5], 0, [3]), ([6, 7, 8, 9], 0, [4])]
    assert inp.prepare(chunks, None, None, 4, [3, 0, 1]) == 9
    assert inp.logit_rows.tolist() == [0, 1, 2, 8] + [0] * 8
    with pytest.raises(ValueError, match="samples at most 3"):
        inp.prepare([([1] * 5, 0, [0, 1])], None, None, 4, [4])
    with pytest.raises(ValueError, match="samples at most 3"):
        inp.prepare([([1], 0, [0])], None, None, 4, [2])  # more rows than the chunk has


@pytest.mark.parametrize("rows_per_segment", [1, 4])
def test_the_plans_figure_for_the_inputs_is_what_they_hold(rows_per_segment):
    """The memory plan reserves ``prefill_graph_inputs_bytes`` for each set of graph inputs: exactly the
    device tensors one holds."""
    inp = PrefillGraphInputs(48, 5, 7, "cpu", rows_per_segment)
    held = inp._device64.nbytes + inp._device32.nbytes
    assert prefill_graph_inputs_bytes(48, 5, 7, rows_per_segment) == held


@pytest.mark.parametrize("segments", [2, 4], ids=["padding_segments", "all_segments"])
def test_tokens_as_decode_rows_attend_as_their_segments(segments):
    """``prefill_graph_rows`` reads only the inputs' device form: every real token, as a decode row over its
    own causal context, attends exactly as in its segment (the reference over the host segments); padding
    tokens get finite rows (whether the last segment is padding or real)."""
    torch.manual_seed(0)
    block_size, heads, dim = 4, 2, 8
    cache = torch.randn(2, 40, block_size, heads, dim)
    inputs = PrefillGraphInputs(32, 4, 10, "cpu")
    pages = torch.randperm(40).tolist()
    # (new tokens, cached tokens before them): a prompt, a tail after a hit, a verification chunk, one token
    shapes = [(7, 0), (3, 13), (4, 21), (1, 9)][:segments]
    chunks, first = [], 0
    for n, cached in shapes:
        table = pages[first : first + 10]
        chunks.append((list(range(n)), cached, table))
        first += 10
    tokens = inputs.prepare(chunks, None, None, block_size)
    size = 16
    meta = AttentionMetadata(
        block_size, inputs.slot_mapping[:size], inputs.segments(len(chunks), block_size), size
    )
    meta.derived.update(cu_seqlens=inputs.cu_seqlens, segment_tables=inputs.block_tables)
    q = torch.randn(size, heads, dim)
    expected = paged_attention_reference(q, cache, meta, 0.3)[:tokens]
    rows = prefill_graph_rows(meta, inputs.positions[:size])
    assert rows.num_decodes == size and not rows.prefills and rows.max_decode_seq_len == 40
    got = paged_attention_reference(q, cache, rows, 0.3)
    torch.testing.assert_close(got[:tokens], expected)
    assert torch.isfinite(got[tokens:]).all()


@pytest.mark.parametrize("slots", [[-1, -1, -1], [5, 2, -1, -1]], ids=["capture-placeholders", "a-step"])
def test_padding_rows_write_nothing_new_in_a_graph(slots):
    """The sync-free form of the torch cache writes (what graphs capture): padding repeats the first row's
    write, and a batch of padding only (graph capture) stays inside the cache, at slot 0."""
    cache = torch.zeros(8, 3)
    rows = torch.arange(1.0, 1 + 3 * len(slots)).view(-1, 3)
    slot_mapping = torch.tensor(slots)
    written, (values,) = padding_as_first_row(slot_mapping, rows)
    cache.index_copy_(0, written, values)
    expected = torch.zeros(8, 3)
    for slot, row in zip(slots, rows, strict=True):
        if slot >= 0:
            expected[slot] = row
    if slots[0] < 0:
        expected[0] = rows[0]
    torch.testing.assert_close(cache, expected)


def test_inputs_refuse_a_step_too_large():
    inp = PrefillGraphInputs(max_tokens=8, max_segments=2, max_blocks_per_seq=4, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="at most 8 tokens in 2 segments"):
        inp.prepare([([1] * 9, 0, [0, 1, 2])], None, None, 4)
    with pytest.raises(ValueError, match="not 3 in 3"):
        inp.prepare([([1], 0, [0])] * 3, None, None, 4)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_padded_prefill_equals_the_plain_path(tiny_qwen3, async_scheduling):
    """Prompts chunked at 24 tokens (chunks that sample nothing), several requests' chunks in one step,
    prompts past the largest bucket (eager), prefix hits (short tails): the plain path's greedy tokens."""
    options = dict(
        dtype="float32", device="cpu", cpu_kv_cache_bytes=8 << 20, max_model_len=256, block_size=4,
        max_num_seqs=8, long_prefill_token_threshold=24, async_scheduling=async_scheduling,
        prefill_graph_max_tokens=32,
    )  # fmt: skip
    rng = random.Random(4)
    base = [rng.randrange(990) for _ in range(60)]
    prompts = [base] + [
        base[: rng.randrange(5, 60)] + [rng.randrange(990) for _ in range(n)] for n in (3, 9, 20)
    ]
    prompts += [[rng.randrange(990) for _ in range(n)] for n in (2, 7, 40)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    plain = LLM(str(tiny_qwen3), **options)
    expected = [
        o.outputs[0].token_ids for o in plain.generate(prompt_token_ids=prompts, sampling_params=params)
    ]
    padded = LLM(str(tiny_qwen3), **options)
    padded.engine.executor.capture_cuda_graphs(eager=True)
    graphs = padded.engine.executor.runner.prefill_graphs
    assert graphs.buckets == [1, 2, 4, 8, 16, 32]
    steps = []
    run = graphs.run

    def recording_run(chunks, state_slots, checkpoints):
        steps.append([c.num_logits for c in chunks])
        return run(chunks, state_slots, checkpoints)

    graphs.run = recording_run
    for _ in range(2):  # the second round hits the first one's pages
        outs = padded.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
        padded.engine.buffers.check_invariants()
    assert any(len(s) > 1 for s in steps), "no step ran several requests' chunks"
    assert any(0 in s for s in steps), "no step ran a chunk that samples nothing"
    assert any(o.num_cached_tokens for o in outs)


@pytest.mark.gpu
def test_prefill_graphs_equal_eager_on_the_gpu(tiny_checkpoint_factory):
    from pegainfer.testing.conformance import assert_prefill_graphs_match_eager

    folder = tiny_checkpoint_factory("qwen3", seed=3, dtype="bfloat16")
    assert_prefill_graphs_match_eager(folder)
