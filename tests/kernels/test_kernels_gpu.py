"""The kernels at Qwen3-14B sizes in bf16 on a CUDA GPU (``nox -s gpu``; skipped without CUDA).

Attention is compared with the torch reference run in float32 on the same bf16 inputs (a near-exact
truth): relative L2 error below 1e-2 (bf16 output rounding alone is ~2e-3). Decode is also captured in
a CUDA graph and replayed after the lengths and block tables change in place. Fused ops must agree
with their bf16 references to one ulp (rtol 2^-7) on at least 99% of elements.
"""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import PagedKV, rel_err
from test_fused_ops import assert_ulp_close

from pegainfer.kernels import activations, norms, rope_kv
from pegainfer.kernels.paged_decode_attention import paged_decode_attention, paged_decode_attention_ref
from pegainfer.kernels.paged_prefill_attention import (
    paged_prefill_attention,
    paged_prefill_attention_ref,
    prefill_tensors,
)
from pegainfer.layers.attention import PrefillSegment
from pegainfer.layers.rotary import RotaryEmbedding

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

HEADS, KV_HEADS, D, BLOCK = 40, 8, 128, 16
BF16 = torch.bfloat16


def _decode_case(gen, lens, width):
    kv = PagedKV(sum(-(-n // BLOCK) for n in lens) + 8, BLOCK, KV_HEADS, D, BF16, "cuda", gen)
    tables = kv.tables([kv.add(n) for n in lens], width=width)
    q = torch.randn(len(lens), HEADS, D, generator=gen).to(BF16).cuda()
    return q, kv, tables, torch.tensor(lens, dtype=torch.int32, device="cuda")


def _f32_ref_decode(q, cache, tables, seq_lens):
    return paged_decode_attention_ref(q.float(), cache.nan_to_num(0.0).float(), tables, seq_lens, D**-0.5)


@pytest.mark.parametrize("num_splits", [None, 1, 8])
def test_decode_qwen3_14b_shapes(num_splits):
    gen = torch.Generator().manual_seed(11)
    lens = torch.randint(1, 4097, (64,), generator=gen).tolist()
    lens[5] = lens[40] = 0  # padding rows
    lens[6] = 1
    q, kv, tables, seq_lens = _decode_case(gen, lens, width=4096 // BLOCK)
    got = paged_decode_attention(q, kv.cache, tables, seq_lens, D**-0.5, num_splits=num_splits)
    ref = _f32_ref_decode(q, kv.cache, tables, seq_lens)
    assert rel_err(got, ref) < 1e-2
    assert (got[5] == 0).all() and (got[40] == 0).all()


def test_decode_replays_in_a_cuda_graph():
    """Persistent buffers, a graph captured once at a static maximum, lengths changed between replays."""
    gen = torch.Generator().manual_seed(12)
    batch, width = 32, 2048 // BLOCK
    lens_a = torch.randint(1, 2049, (batch,), generator=gen).tolist()
    q, kv, tables, seq_lens = _decode_case(gen, lens_a, width)
    kv.cache.copy_(kv.cache.nan_to_num(0.0))  # the replays draw random tables that may point anywhere
    out = torch.empty_like(q)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        paged_decode_attention(q, kv.cache, tables, seq_lens, D**-0.5, out=out)  # compile outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(q, kv.cache, tables, seq_lens, D**-0.5, out=out, max_seq_len=2048)
    for step in range(3):
        lens = torch.randint(0, 2049, (batch,), generator=gen)
        lens[: step + 1] = 0
        new_tables = torch.randint(0, kv.cache.shape[1], (batch, width), generator=gen, dtype=torch.int32)
        tables.copy_(new_tables)
        seq_lens.copy_(lens)
        q.copy_(torch.randn(q.shape, generator=gen).to(BF16))
        out.fill_(float("nan"))
        graph.replay()
        ref = _f32_ref_decode(q, kv.cache, tables, seq_lens)
        assert rel_err(out, ref) < 1e-2
        assert (out[: step + 1] == 0).all()


def test_prefill_qwen3_14b_shapes():
    """4 fresh prompts of 1024, a 512-token chunk behind a 3000-token prefix, a 1-token chunk."""
    gen = torch.Generator().manual_seed(13)
    shapes = [(1024, 1024)] * 4 + [(512, 3512), (1, 777)]
    kv = PagedKV(sum(-(-c // BLOCK) for _, c in shapes) + 8, BLOCK, KV_HEADS, D, BF16, "cuda", gen)
    segs, start = [], 0
    for q_len, ctx in shapes:
        segs.append(PrefillSegment(start, q_len, ctx, kv.add(ctx)))
        start += q_len
    q = torch.randn(start + 4, HEADS, D, generator=gen).to(BF16).cuda()
    meta = prefill_tensors(segs, "cuda")
    out = torch.full_like(q, 3.0)
    got = paged_prefill_attention(q, kv.cache, meta, D**-0.5, out=out)
    ref = paged_prefill_attention_ref(q.float(), kv.cache.nan_to_num(0.0).float(), meta, D**-0.5)
    assert rel_err(got[:start], ref[:start]) < 1e-2
    assert (got[start:] == 3.0).all()


def test_prefill_short_chunk_over_long_context_splits_keys():
    """The Qwen3.5 9B attention shape (16 heads over 4 kv heads of 256): a 64-token chunk behind 2048
    cached tokens splits its keys over programs (key_splits) and still matches the reference."""
    from pegainfer.kernels.paged_prefill_attention import key_splits

    gen = torch.Generator().manual_seed(15)
    heads, kv_heads, d = 16, 4, 256
    kv = PagedKV(2112 // BLOCK + 4, BLOCK, kv_heads, d, BF16, "cuda", gen)
    segs = [PrefillSegment(0, 64, 2112, kv.add(2112))]
    meta = prefill_tensors(segs, "cuda")
    assert key_splits(heads, 1, meta.max_ctx_len, torch.device("cuda")) > 1
    q = torch.randn(64, heads, d, generator=gen).to(BF16).cuda()
    got = paged_prefill_attention(q, kv.cache, meta, d**-0.5)
    ref = paged_prefill_attention_ref(q.float(), kv.cache.nan_to_num(0.0).float(), meta, d**-0.5)
    assert rel_err(got, ref) < 1e-2


def test_fused_ops_qwen3_14b_shapes():
    gen = torch.Generator().manual_seed(14)
    t, hidden, inter = 256, 5120, 17408

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(BF16).cuda()

    x, res, w = rand(t, hidden), rand(t, hidden, scale=4.0), rand(hidden)
    assert_ulp_close(norms.rms_norm(x, w, 1e-6), norms.rms_norm_ref(x, w, 1e-6))
    res_k, res_r = res.clone(), res.clone()
    out_k, _ = norms.fused_add_rms_norm(x, res_k, w, 1e-6)
    out_r, _ = norms.fused_add_rms_norm_ref(x, res_r, w, 1e-6)
    assert torch.equal(res_k, res_r)
    assert_ulp_close(out_k, out_r)
    gate_up = rand(t, 2 * inter, scale=3.0)
    assert_ulp_close(activations.silu_mul(gate_up), activations.silu_mul_ref(gate_up))

    qkv = rand(t, (HEADS + 2 * KV_HEADS) * D, scale=2.0)
    q, k, v = qkv.split([HEADS * D, KV_HEADS * D, KV_HEADS * D], dim=-1)
    q, k, v = q.view(t, HEADS, D), k.view(t, KV_HEADS, D), v.view(t, KV_HEADS, D)
    rotary = RotaryEmbedding(D, 1e6, 40960).cuda()
    pos = torch.randint(0, 40960, (t,), generator=gen).cuda()
    slots = torch.randperm(64 * BLOCK, generator=gen)[:t].cuda()
    cache_k = rand(2, 64, BLOCK, KV_HEADS, D)
    cache_r = cache_k.clone()
    got = rope_kv.qk_norm_rope(q, k, rand(D), rand(D), rotary, pos, 1e-6)
    assert got[0].shape == q.shape
    qw, kw = rand(D), rand(D)
    got = rope_kv.qk_norm_rope(q, k, qw, kw, rotary, pos, 1e-6, kv_cache=cache_k, v=v, slot_mapping=slots)
    ref = rope_kv.qk_norm_rope_ref(q, k, qw, kw, rotary, pos, 1e-6, kv_cache=cache_r, v=v, slot_mapping=slots)
    assert_ulp_close(got[0], ref[0])
    assert_ulp_close(got[1], ref[1])
    assert_ulp_close(cache_k, cache_r)
    cache_w, cache_wr = cache_k.clone(), cache_k.clone()
    rope_kv.write_kv(cache_w, k, v, slots)
    rope_kv.write_kv_ref(cache_wr, k, v, slots)
    assert torch.equal(cache_w, cache_wr)
