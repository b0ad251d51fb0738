"""Fused small-op kernels vs their torch references.

The kernels round where the references round, so fp32 agrees to 1e-6 relative and bf16/fp16 agree
to within one unit in the last place (``rtol`` = 2^-7 for bf16, 2^-10 for fp16) on almost every
element (at most 1% may differ by that ulp: the GPU's approximate rsqrt/exp can flip a rounding).
"""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import DEVICE

from pegainfer.kernels import activations, norms, rope_kv
from pegainfer.layers.rotary import RotaryEmbedding

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ULP = {torch.float32: 1e-6, torch.bfloat16: 2**-7, torch.float16: 2**-10}


def _rand(gen, *shape, dtype, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


def assert_ulp_close(got: torch.Tensor, ref: torch.Tensor) -> None:
    assert got.shape == ref.shape and got.dtype == ref.dtype
    assert torch.isfinite(got).all()
    tol = ULP[got.dtype]
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
    # The interpreter rounds exactly like the reference; compiled GPU code contracts multiply-adds (FMA),
    # so there only the one-ulp bound holds.
    if got.dtype != torch.float32 and DEVICE == "cpu":
        assert (got != ref).float().mean().item() <= 0.01


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 64), (7, 300), (2, 3, 128)], ids=["1x64", "7x300", "2x3x128"])
def test_rms_norm(dtype, shape):
    gen = torch.Generator().manual_seed(1)
    x, w = _rand(gen, *shape, dtype=dtype, scale=3.0), _rand(gen, shape[-1], dtype=dtype)
    assert_ulp_close(norms.rms_norm_triton(x, w, 1e-6), norms.rms_norm_ref(x, w, 1e-6))
    out = x.clone()
    assert norms.rms_norm_triton(out, w, 1e-6, out=out) is out, "out may alias x"
    assert_ulp_close(out, norms.rms_norm_ref(x, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_without_weight(dtype):
    """A norm whose weight is folded into the next projection: the plain normalised row, with or
    without the residual add."""
    gen = torch.Generator().manual_seed(11)
    x, res = _rand(gen, 3, 200, dtype=dtype, scale=3.0), _rand(gen, 3, 200, dtype=dtype)
    ref = norms.rms_norm_ref(x, None, 1e-6)
    assert torch.equal(ref, norms.rms_norm_ref(x, torch.ones(200, dtype=dtype, device=DEVICE), 1e-6))
    assert_ulp_close(norms.rms_norm_triton(x, None, 1e-6), ref)
    res_k, res_r = res.clone(), res.clone()
    out, _ = norms.fused_add_rms_norm_triton(x, res_k, None, 1e-6)
    ref_out, _ = norms.fused_add_rms_norm_ref(x, res_r, None, 1e-6)
    assert torch.equal(res_k, res_r)
    assert_ulp_close(out, ref_out)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_add_rms_norm_updates_residual_in_place(dtype):
    gen = torch.Generator().manual_seed(2)
    x, res, w = (
        _rand(gen, 5, 192, dtype=dtype),
        _rand(gen, 5, 192, dtype=dtype, scale=4.0),
        _rand(gen, 192, dtype=dtype),
    )
    res_k, res_r = res.clone(), res.clone()
    out, new_res = norms.fused_add_rms_norm_triton(x.clone(), res_k, w, 1e-5)
    ref_out, ref_res = norms.fused_add_rms_norm_ref(x.clone(), res_r, w, 1e-5)
    assert new_res is res_k
    assert torch.equal(res_k, ref_res), "the residual sum rounds exactly as torch's add"
    assert_ulp_close(out, ref_out)
    # The normed output may overwrite x (the attention/MLP output buffer).
    x2, res2 = x.clone(), res.clone()
    out2, _ = norms.fused_add_rms_norm_triton(x2, res2, w, 1e-5, out=x2)
    assert out2 is x2 and torch.equal(out2, out)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,rotary_dim",
    [(8, 2, 128, 128), (5, 1, 64, 64), (4, 4, 64, 32)],
    ids=["g4-d128", "g5-d64", "partial-rotary"],
)
def test_qk_norm_rope(dtype, heads, kv_heads, head_dim, rotary_dim):
    gen = torch.Generator().manual_seed(3)
    t = 6
    qkv = _rand(gen, t, (heads + 2 * kv_heads) * head_dim, dtype=dtype, scale=2.0)
    q = qkv[:, : heads * head_dim].view(t, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(t, kv_heads, head_dim)
    qw, kw = _rand(gen, head_dim, dtype=dtype), _rand(gen, head_dim, dtype=dtype)
    rotary = RotaryEmbedding(rotary_dim, 1e6, 4096).to(DEVICE)
    pos = torch.randint(0, 4096, (t,), generator=gen).to(DEVICE)
    got_q, got_k = rope_kv.qk_norm_rope_triton(q, k, qw, kw, rotary, pos, 1e-6)
    ref_q, ref_k = rope_kv.qk_norm_rope_ref(q, k, qw, kw, rotary, pos, 1e-6)
    assert_ulp_close(got_q, ref_q)
    assert_ulp_close(got_k, ref_k)
    before = qkv.clone()
    in_q, in_k = rope_kv.qk_norm_rope_triton(q, k, qw, kw, rotary, pos, 1e-6, inplace=True)
    assert in_q.data_ptr() == q.data_ptr() and torch.equal(in_q, got_q) and torch.equal(in_k, got_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], before[:, (heads + kv_heads) * head_dim :])


def test_qk_norm_rope_writes_cache_and_skips_negative_slots():
    gen = torch.Generator().manual_seed(4)
    t, heads, kv_heads, d, dtype = 5, 8, 2, 64, torch.bfloat16
    qkv = _rand(gen, t, (heads + 2 * kv_heads) * d, dtype=dtype)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k, v = q.view(t, heads, d), k.view(t, kv_heads, d), v.view(t, kv_heads, d)
    qw, kw = _rand(gen, d, dtype=dtype), _rand(gen, d, dtype=dtype)
    rotary = RotaryEmbedding(d, 1e4, 256).to(DEVICE)
    pos = torch.randint(0, 256, (t,), generator=gen).to(DEVICE)
    slots = torch.tensor([3, 40, -1, 17, 63]).to(DEVICE)
    cache_k = _rand(gen, 2, 4, 16, kv_heads, d, dtype=dtype)
    cache_r = cache_k.clone()
    got = rope_kv.qk_norm_rope_triton(
        q, k, qw, kw, rotary, pos, 1e-6, kv_cache=cache_k, v=v, slot_mapping=slots
    )
    ref = rope_kv.qk_norm_rope_ref(q, k, qw, kw, rotary, pos, 1e-6, kv_cache=cache_r, v=v, slot_mapping=slots)
    assert_ulp_close(got[0], ref[0])
    assert_ulp_close(cache_k, cache_r)  # also proves slot -1 wrote nothing: cache_r skipped it


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(3, 2 * 200), (2, 2, 2 * 1500)], ids=["3x200", "2x2x1500"])
def test_silu_mul(dtype, shape):
    gen = torch.Generator().manual_seed(5)
    x = _rand(gen, *shape, dtype=dtype, scale=3.0)
    assert_ulp_close(activations.silu_mul_triton(x, block=256), activations.silu_mul_ref(x))
    out = torch.full((*shape[:-1], shape[-1] // 2), float("nan"), dtype=dtype, device=DEVICE)
    assert activations.silu_mul_triton(x, out=out) is out
    assert_ulp_close(out, activations.silu_mul_ref(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kv_heads,head_dim", [(2, 64), (3, 128)], ids=["2x64", "3x128"])
def test_write_kv(dtype, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(6)
    t = 9
    kv = _rand(gen, t, 2 * kv_heads * head_dim + 8, dtype=dtype)  # strided views, as split from qkv
    k = kv[:, : kv_heads * head_dim].view(t, kv_heads, head_dim)
    v = kv[:, kv_heads * head_dim : 2 * kv_heads * head_dim].view(t, kv_heads, head_dim)
    slots = torch.randperm(6 * 16, generator=gen)[:t].to(DEVICE)
    cache_k = _rand(gen, 2, 6, 16, kv_heads, head_dim, dtype=dtype)
    cache_r = cache_k.clone()
    rope_kv.write_kv_triton(cache_k, k, v, slots)
    rope_kv.write_kv_ref(cache_r, k, v, slots)
    assert torch.equal(cache_k, cache_r)
    before = cache_k.clone()
    rope_kv.write_kv_triton(cache_k, k, v, torch.full_like(slots, -1))
    assert torch.equal(cache_k, before), "negative slots (padding rows) are skipped"
    # Padding rows after real ones, other values than row 0's: the reference leaves their slots alone
    # too, on the CPU by dropping them, on CUDA (graph-safe) by writing row 0 again.
    padded = slots.clone()
    padded[t // 2 :] = -1
    cache_k = _rand(gen, 2, 6, 16, kv_heads, head_dim, dtype=dtype)
    cache_r, before = cache_k.clone(), cache_k.clone()
    rope_kv.write_kv_triton(cache_k, k, v, padded)
    rope_kv.write_kv_ref(cache_r, k, v, padded)
    assert torch.equal(cache_k, cache_r) and not torch.equal(cache_k, before)
    flat = cache_k.flatten(1, 2)
    assert torch.equal(flat[:, slots[t // 2 :]], before.flatten(1, 2)[:, slots[t // 2 :]])


def test_dispatch_takes_reference_off_cuda():
    gen = torch.Generator().manual_seed(7)
    x, w = torch.randn(3, 32, generator=gen), torch.randn(32, generator=gen)
    assert torch.equal(norms.rms_norm(x, w, 1e-6), norms.rms_norm_ref(x, w, 1e-6))
    g = torch.randn(3, 64, generator=gen)
    assert torch.equal(activations.silu_mul(g), activations.silu_mul_ref(g))


def test_silu_mul_reference_pairs_alternating_columns():
    """Columns alternate gate, up (the layout interleave_gate_up gives the packed weight); the result is
    bit for bit silu over a contiguous gate times up, as transformers computes it."""
    packed = torch.randn(4, 2 * 300, generator=torch.Generator().manual_seed(12))
    gate, up = packed[:, 0::2].contiguous(), packed[:, 1::2].contiguous()
    assert torch.equal(activations.silu_mul_ref(packed), torch.nn.functional.silu(gate) * up)
