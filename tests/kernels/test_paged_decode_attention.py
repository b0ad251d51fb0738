"""Decode attention kernel vs the torch reference (``layers.attention.paged_attention_reference``).

Small shapes, run on CPU tensors through the Triton interpreter (or compiled, on a GPU). The cache is
NaN outside the written tokens and block tables are padded with a never-written page, so any read past
a row's length shows up as NaN. Tolerances (relative L2 error): fp32 against the fp32 reference 3e-5
(the GPU runs fp32 dots as tf32x3); bf16 against a float64 reference on the same bf16 inputs 5e-3
(the output's own rounding is ~1e-3) and no worse than twice the bf16 torch reference's own error.
"""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import DEVICE, PagedKV, rel_err

from pegainfer.kernels.paged_decode_attention import (
    DecodeRope,
    decode_num_splits,
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_decode_attention_triton,
)
from pegainfer.layers.rotary import RotaryEmbedding

BLOCK = 16


def _case(seed, heads, kv_heads, head_dim, lens, dtype, *, strided_q=False):
    gen = torch.Generator().manual_seed(seed)
    kv = PagedKV(sum(-(-n // BLOCK) for n in lens) + 4, BLOCK, kv_heads, head_dim, dtype, DEVICE, gen)
    tables = kv.tables([kv.add(n) for n in lens], width=max(-(-n // BLOCK) for n in lens) + 2)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(lens), heads + (3 if strided_q else 0), head_dim, generator=gen).to(dtype).to(DEVICE)
    q = q[:, :heads] if strided_q else q
    return q, kv.cache, tables, seq_lens


def _truth(q, cache, tables, seq_lens, scale):
    clean = cache.nan_to_num(0.0).double()
    return paged_decode_attention_ref(q.double(), clean, tables, seq_lens, scale)


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim",
    [(4, 4, 64), (8, 2, 64), (16, 2, 128)],
    ids=["g1-d64", "g4-d64", "g8-d128"],
)
@pytest.mark.parametrize("num_splits", [1, 3, None], ids=["splits1", "splits3", "splits-auto"])
def test_decode_fp32_matches_reference(heads, kv_heads, head_dim, num_splits):
    lens = [1, 37, 0, 203, 16]  # one token, odd, padding row, many pages, exactly one page
    q, cache, tables, seq_lens = _case(1, heads, kv_heads, head_dim, lens, torch.float32, strided_q=True)
    scale = head_dim**-0.5
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=DEVICE)
    got = paged_decode_attention_triton(q, cache, tables, seq_lens, scale, out=out, num_splits=num_splits)
    assert got.data_ptr() == out.data_ptr()
    ref = paged_decode_attention_ref(q, cache.nan_to_num(0.0), tables, seq_lens, scale)
    assert rel_err(got, ref) < 3e-5
    assert torch.equal(got[2], torch.zeros_like(got[2])), "a padding row (seq_len 0) must give zeros"


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 1, 128), (8, 2, 64)], ids=["g8-d128", "g4-d64"])
def test_decode_bf16_close_to_float64(heads, kv_heads, head_dim):
    lens = [70, 5, 0, 129]
    q, cache, tables, seq_lens = _case(2, heads, kv_heads, head_dim, lens, torch.bfloat16)
    scale = head_dim**-0.5
    got = paged_decode_attention_triton(q, cache, tables, seq_lens, scale, num_splits=4)
    assert got.dtype == torch.bfloat16
    truth = _truth(q, cache, tables, seq_lens, scale)
    assert rel_err(got, truth) < 5e-3
    assert (
        rel_err(got, truth)
        <= 2 * rel_err(paged_decode_attention_ref(q, cache.nan_to_num(0.0), tables, seq_lens, scale), truth)
        + 1e-3
    )


def test_split_count_changes_nothing_but_rounding():
    """Splits (from 1 to more than a row has tiles) and a too-small ``max_seq_len`` hint (which only
    picks the split count) give the same result: lengths are read on the device, never from the hint."""
    lens = [300, 2, 77]
    q, cache, tables, seq_lens = _case(3, 8, 2, 64, lens, torch.float32)
    base = paged_decode_attention_triton(q, cache, tables, seq_lens, 0.125, num_splits=1)
    for kwargs in ({"num_splits": 2}, {"num_splits": 7}, {"num_splits": 64}, {"max_seq_len": 16}):
        other = paged_decode_attention_triton(q, cache, tables, seq_lens, 0.125, **kwargs)
        assert rel_err(other, base) < 1e-5, kwargs


def test_num_splits_heuristic_uses_static_sizes_only():
    assert decode_num_splits(1, 8, 1024) == 16  # 1024 / 64-token chunks
    assert decode_num_splits(1, 8, 40960) == 64  # 4 programs per SM of 132 is 66, capped at MAX_SPLITS
    assert decode_num_splits(128, 8, 40960) == 1
    assert 1 <= decode_num_splits(0, 8, 0) <= 64


def test_dispatch_takes_reference_off_cuda():
    q, cache, tables, seq_lens = _case(4, 4, 2, 64, [9, 20], torch.float32)
    cache = cache.nan_to_num(0.0).cpu()
    got = paged_decode_attention(q.cpu(), cache, tables.cpu(), seq_lens.cpu(), 0.125)
    assert torch.equal(got, paged_decode_attention_ref(q.cpu(), cache, tables.cpu(), seq_lens.cpu(), 0.125))


def _rope_case(seed, heads, kv_heads, head_dim, rotary_dim, lens, dtype):
    """A decode batch before the layer's q/k norm and rotary: the cache holds every row's context but the
    new (last) token, whose slot is NaN until written; q and the new k, v are raw views of one q|k|v."""
    q, cache, tables, seq_lens = _case(seed, heads, kv_heads, head_dim, lens, dtype)
    gen = torch.Generator().manual_seed(seed + 100)
    b = len(lens)
    positions = (seq_lens.long() - 1).clamp_min(0)
    blocks = tables.long().gather(1, (positions // BLOCK)[:, None]).squeeze(1)
    slots = torch.where(seq_lens > 0, blocks * BLOCK + positions % BLOCK, -1)
    cache.flatten(1, 2)[:, slots[seq_lens > 0]] = float("nan")
    qkv = (torch.randn(b, (heads + 2 * kv_heads) * head_dim, generator=gen) * 2).to(dtype).to(DEVICE)
    q = qkv[:, : heads * head_dim].view(b, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(b, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(b, kv_heads, head_dim)
    weights = [torch.randn(head_dim, generator=gen).to(dtype).to(DEVICE) for _ in range(2)]
    rotary = RotaryEmbedding(rotary_dim, 1e6, 4096).to(DEVICE)
    return q, cache, tables, seq_lens, (k, v, *weights, rotary, positions, slots.to(DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,rotary_dim",
    [(8, 2, 64, 64), (5, 1, 64, 32), (16, 2, 128, 128)],
    ids=["g4-d64", "g5-partial-rotary", "g8-d128"],
)
@pytest.mark.parametrize("num_splits", [1, 3, None], ids=["splits1", "splits3", "splits-auto"])
def test_decode_with_rope_equals_rope_then_attention(
    dtype, heads, kv_heads, head_dim, rotary_dim, num_splits
):
    """The fused q/k norm + rotary + cache write: the same output and the same cache as the reference
    sequence (rope_kv's reference with its write, then attention), the padding row writing nothing."""
    lens = [1, 37, 0, 203, 16]
    q, cache, tables, seq_lens, rope_args = _rope_case(5, heads, kv_heads, head_dim, rotary_dim, lens, dtype)
    k, v, *rest = rope_args
    ref_cache = cache.nan_to_num(0.0)  # the reference reads (and masks) past each row's length
    ref_rope = DecodeRope(k.clone(), v, *rest, eps=1e-6)
    ref = paged_decode_attention_ref(q, ref_cache, tables, seq_lens, head_dim**-0.5, rope=ref_rope)
    out = torch.full(q.shape, float("nan"), dtype=dtype, device=DEVICE)
    rope = DecodeRope(k.clone(), v, *rest, eps=1e-6)
    got = paged_decode_attention_triton(
        q, cache, tables, seq_lens, head_dim**-0.5, out=out, num_splits=num_splits, rope=rope
    )
    assert got.data_ptr() == out.data_ptr()
    ulp = 1e-6 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(cache.nan_to_num(0.0), ref_cache, rtol=ulp, atol=ulp)
    assert not cache.flatten(1, 2)[:, rest[-1][seq_lens > 0]].isnan().any(), "every new token is written"
    assert rel_err(got, ref) < (3e-5 if dtype == torch.float32 else 5e-3)
    assert torch.equal(got[2], torch.zeros_like(got[2])), "a padding row (seq_len 0) must give zeros"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_splits", [1, 3], ids=["splits1", "splits3"])
def test_gated_attention_form_equals_its_reference_sequence(dtype, num_splits):
    """Qwen3.5's gated attention in the same two kernels: zero-centred q/k norms (scale ``1 + w`` in fp32),
    a quarter of the head rotated, and the output times ``sigmoid(gate)``, where q and gate are the
    interleaved halves of each head of the projection (strided views)."""
    heads, kv_heads, d, lens = 6, 2, 64, [1, 37, 0, 203]
    q, cache, tables, seq_lens, (k, v, qw, kw, _, positions, slots) = _rope_case(
        9, heads, kv_heads, d, d // 4, lens, dtype
    )
    rotary = RotaryEmbedding(d // 4, 1e7, 4096).to(DEVICE)
    gen = torch.Generator().manual_seed(19)
    query_gate = torch.randn(len(lens), heads, 2 * d, generator=gen).to(dtype).to(DEVICE)
    q, gate = query_gate[..., :d], query_gate[..., d:]
    ref_cache = cache.nan_to_num(0.0)
    ref_rope = DecodeRope(k.clone(), v, qw, kw, rotary, positions, slots, 1e-6, zero_centred=True)
    ref = paged_decode_attention_ref(q, ref_cache, tables, seq_lens, d**-0.5, rope=ref_rope, gate=gate)
    plain = paged_decode_attention_ref(
        q,
        cache.nan_to_num(0.0),
        tables,
        seq_lens,
        d**-0.5,
        rope=DecodeRope(k.clone(), v, qw, kw, rotary, positions, slots, 1e-6),
    )
    assert rel_err(plain * torch.sigmoid(gate), ref) > 0.05, (
        "the zero-centred scale must differ from the plain one"
    )
    rope = DecodeRope(k.clone(), v, qw, kw, rotary, positions, slots, 1e-6, zero_centred=True)
    got = paged_decode_attention_triton(
        q, cache, tables, seq_lens, d**-0.5, num_splits=num_splits, rope=rope, gate=gate
    )
    ulp = 1e-6 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(cache.nan_to_num(0.0), ref_cache, rtol=ulp, atol=ulp)
    assert rel_err(got, ref) < (3e-5 if dtype == torch.float32 else 5e-3)
    assert torch.equal(got[2], torch.zeros_like(got[2])), "a padding row (seq_len 0) must give zeros"
    with pytest.raises(ValueError, match="gate"):
        paged_decode_attention_triton(q, cache, tables, seq_lens, d**-0.5, rope=rope, gate=gate[:, :1])


def test_decode_with_rope_rejects_mismatched_inputs():
    q, cache, tables, seq_lens, (k, v, *rest) = _rope_case(6, 4, 2, 64, 64, [5, 9], torch.float32)
    with pytest.raises(ValueError, match="rope.k"):
        paged_decode_attention_triton(
            q, cache, tables, seq_lens, 0.125, rope=DecodeRope(k[:, :1], v, *rest, 1e-6)
        )
    with pytest.raises(ValueError, match="rope.v"):
        paged_decode_attention_triton(
            q, cache, tables, seq_lens, 0.125, rope=DecodeRope(k, v.double(), *rest, 1e-6)
        )
