"""The skinny (decode) GEMM kernel vs its torch reference on fresh random inputs.

Both accumulate in fp32 but in different orders, so 16-bit outputs may differ by an ulp of the output
where the rounding is close; the bound is relative to the output scale. fp32 agrees to 1e-5.
"""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import DEVICE, rel_err

from pegainfer.kernels import skinny_gemm
from pegainfer.kernels.activations import silu_mul_ref
from pegainfer.kernels.skinny_gemm import (
    DISPATCH_ROWS,
    MAX_ROWS,
    GatedNorm,
    RowNorm,
    SkinnyConfig,
    _one_program_per_sm,
    default_config,
    gemv_preload_triton,
    preload_fits,
    skinny_linear,
    skinny_linear_ref,
    skinny_linear_triton,
)
from pegainfer.layers.activation import interleave_gate_up
from pegainfer.layers.norm import fold_rms_norm_weight, rms_norm_gated

TOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}

# Stream-K splits: 3 tiles x 8 column blocks over 5 programs of 5 units (whole tiles, tiles split in two
# and three, a program on two tiles); ragged N and K over 3 programs; 4 x 4 units, one per program.
STREAM_K_WHOLE_AND_SPLIT = SkinnyConfig(32, 32, stream_k=True, programs=5)
STREAM_K_RAGGED = SkinnyConfig(32, 32, stream_k=True, programs=3)
STREAM_K_ONE_UNIT_EACH = SkinnyConfig(32, 32, stream_k=True, programs=16)


def _rand(gen, *shape, dtype):
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    ("m", "n", "k", "config"),
    [
        (1, 64, 256, SkinnyConfig(32, 64)),
        (3, 70, 160, SkinnyConfig(32, 64)),  # ragged N and K: masked edges
        (16, 96, 128, SkinnyConfig(64, 32, num_stages=2)),
        (40, 48, 64, SkinnyConfig(16, 32)),  # a 64-row x tile
        (5, 33, 100, None),  # the default tiles, larger than the problem
        (1, 96, 256, STREAM_K_WHOLE_AND_SPLIT),
        (3, 70, 160, STREAM_K_RAGGED),
        (16, 128, 128, STREAM_K_ONE_UNIT_EACH),
    ],
    ids=[
        "1x64x256",
        "3x70x160-ragged",
        "16x96x128",
        "40x48x64",
        "5x33x100-default",
        "1x96x256-stream_k",
        "3x70x160-stream_k-ragged",
        "16x128x128-stream_k-unit-each",
    ],  # fmt: skip
)
def test_matches_linear(dtype, m, n, k, config):
    gen = torch.Generator().manual_seed(m * n + k)
    x, w, bias = _rand(gen, m, k, dtype=dtype), _rand(gen, n, k, dtype=dtype), _rand(gen, n, dtype=dtype)
    ref = (x.double() @ w.double().T + bias.double()).to(dtype)
    got = skinny_linear_triton(x, w, bias, config=config)
    assert got.shape == (m, n) and got.dtype == dtype
    assert rel_err(got, ref) < TOL[dtype]
    assert rel_err(skinny_linear_triton(x, w, config=config), ref - bias) < TOL[dtype]


@pytest.mark.parametrize("config", [STREAM_K_WHOLE_AND_SPLIT, STREAM_K_ONE_UNIT_EACH], ids=["5", "16"])
def test_stream_k_repeats_bit_for_bit(config):
    """The last program of a split tile adds the partials in a fixed order and resets the tile's counter:
    a second launch (a graph replay) on the same workspace gives the same bits."""
    gen = torch.Generator().manual_seed(11)
    x, w = _rand(gen, 2, 256, dtype=torch.float32), _rand(gen, 96, 256, dtype=torch.float32)
    first = skinny_linear_triton(x, w, config=config)
    assert torch.equal(skinny_linear_triton(x, w, config=config), first)
    assert rel_err(first, x @ w.T) < 1e-5


def test_leading_dims_and_too_many_rows():
    gen = torch.Generator().manual_seed(3)
    x, w = _rand(gen, 2, 3, 64, dtype=torch.float32), _rand(gen, 40, 64, dtype=torch.float32)
    got = skinny_linear_triton(x, w, config=SkinnyConfig(16, 32))
    assert got.shape == (2, 3, 40)
    assert rel_err(got, x @ w.T) < 1e-5
    with pytest.raises(ValueError, match="at most"):
        skinny_linear_triton(_rand(gen, MAX_ROWS + 1, 64, dtype=torch.float32), w)


def test_dispatch_takes_the_reference_off_cuda_and_for_many_rows():
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(24, 32, generator=gen)
    x = torch.randn(DISPATCH_ROWS + 4, 32, generator=gen)
    assert torch.equal(skinny_linear(x, w), torch.nn.functional.linear(x, w))


def _ulp_close(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal up to one rounding of the output dtype (compiled code may contract multiply-adds)."""
    tol = {torch.float32: 1e-6, torch.bfloat16: 2**-7, torch.float16: 2**-10}[got.dtype]
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)


FUSED_CASES = pytest.mark.parametrize(
    ("m", "n", "k", "config"),
    [
        (1, 64, 256, SkinnyConfig(32, 64)),
        (3, 70, 160, SkinnyConfig(32, 64)),
        (16, 96, 128, None),
        (1, 96, 256, STREAM_K_WHOLE_AND_SPLIT),
        (3, 70, 160, STREAM_K_RAGGED),
    ],
    ids=["1x64x256", "3x70x160-ragged", "16x96x128-default", "1x96x256-stream_k", "3x70x160-stream_k"],
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@FUSED_CASES
def test_norm_option_is_rms_norm_then_linear(dtype, m, n, k, config):
    """``norm_eps``: the un-normed rows in, the norm's weight folded into w; every row has its own scale."""
    gen = torch.Generator().manual_seed(m + n + k)
    x = (torch.randn(m, k, generator=gen) * torch.linspace(0.1, 8.0, m)[:, None]).to(dtype).to(DEVICE)
    w, norm_w = _rand(gen, n, k, dtype=dtype), _rand(gen, k, dtype=dtype)
    bias = _rand(gen, n, dtype=dtype)
    x64 = x.double()
    normed = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_w.double()
    ref = (normed @ w.double().T + bias.double()).to(dtype)
    folded = fold_rms_norm_weight(w, norm_w)
    got = skinny_linear_triton(x, folded, bias, config=config, norm_eps=1e-6)
    assert got.shape == (m, n)
    assert rel_err(got, ref) < TOL[dtype]
    assert rel_err(skinny_linear_ref(x, folded, bias, norm_eps=1e-6), ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@FUSED_CASES
def test_silu_option_equals_the_separate_activation(dtype, m, n, k, config):
    """``silu``: gate and up rows interleaved; the epilogue rounds as the GEMM then silu_mul would."""
    n += n % 2
    gen = torch.Generator().manual_seed(7 * m + n)
    x = _rand(gen, m, k, dtype=dtype)
    gate, up = _rand(gen, n // 2, k, dtype=dtype), _rand(gen, n // 2, k, dtype=dtype)
    w = interleave_gate_up(gate, up)
    assert torch.equal(w[0::2], gate) and torch.equal(w[1::2], up)
    got = skinny_linear_triton(x, w, config=config, silu=True)
    assert got.shape == (m, n // 2)
    _ulp_close(got, silu_mul_ref(skinny_linear_triton(x, w, config=config)))
    ref = torch.nn.functional.silu(x.double() @ gate.double().T) * (x.double() @ up.double().T)
    assert rel_err(got, ref.to(dtype)) < 2 * TOL[dtype]
    normed = skinny_linear_triton(x, w, config=config, norm_eps=1e-5, silu=True)
    assert rel_err(normed, skinny_linear_ref(x, w, norm_eps=1e-5, silu=True)) < 2 * TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@FUSED_CASES
def test_residual_option_adds_in_place(dtype, m, n, k, config):
    gen = torch.Generator().manual_seed(m * k + 1)
    x, w = _rand(gen, m, k, dtype=dtype), _rand(gen, n, k, dtype=dtype)
    residual = _rand(gen, m, n, dtype=dtype) * 4
    expected = residual + skinny_linear_triton(x, w, config=config)  # rounded as torch's add
    before = residual.clone()
    got = skinny_linear_triton(x, w, config=config, residual=residual)
    assert got.data_ptr() == residual.data_ptr()
    assert torch.equal(residual, expected)
    ref = skinny_linear_ref(x, w, residual=before)
    assert ref is before and rel_err(residual, ref) < TOL[dtype]


def test_fused_options_reject_what_they_cannot_do():
    gen = torch.Generator().manual_seed(5)
    x, w = _rand(gen, 2, 32, dtype=torch.float32), _rand(gen, 6, 32, dtype=torch.float32)
    with pytest.raises(ValueError, match="silu"):
        skinny_linear_triton(x, w, silu=True, residual=torch.zeros(2, 6, device=DEVICE))
    with pytest.raises(ValueError, match="silu"):
        skinny_linear_triton(x, w[:5], silu=True)
    with pytest.raises(ValueError, match="residual"):
        skinny_linear_triton(x, w, residual=torch.zeros(2, 5, device=DEVICE))


def test_early_launch_only_for_one_program_per_multiprocessor():
    """PDL for the 5120-wide projections' deep tiles, not for gate|up's or lm_head's smaller ones, whose
    early programs would pile onto the idle multiprocessors (docs/benchmarks.md, fifth run)."""
    x = torch.empty(1, 5120, dtype=torch.bfloat16)
    assert _one_program_per_sm(default_config(7168, 5120), 16, x)  # q|k|v, o_proj, down
    assert not _one_program_per_sm(default_config(34816, 5120), 16, x)  # gate|up
    assert not _one_program_per_sm(default_config(151936, 5120), 16, x)  # lm_head


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("n", "k"), [(576, 7168), (4096, 4096), (5120, 17408)], ids=["kv_a", "9b_o", "down"])
@pytest.mark.parametrize("m", [1, 16])
def test_stream_k_at_model_shapes_and_in_a_graph(m, n, k):
    """The split over every multiprocessor at DeepSeek's kv_a and the Qwen 4096/5120-row shapes, bf16:
    each option against the reference, and a graph replay equal to the eager launch bit for bit."""
    gen = torch.Generator().manual_seed(n + m)
    x = (_rand(gen, m, k, dtype=torch.bfloat16) * 0.5).cuda()
    w = (_rand(gen, n, k, dtype=torch.bfloat16) * 0.02).cuda()
    cfg = SkinnyConfig(64, 256, stream_k=True)
    tol = TOL[torch.bfloat16]
    assert rel_err(skinny_linear_triton(x, w, config=cfg), skinny_linear_ref(x, w)) < tol
    normed = skinny_linear_triton(x, w, config=cfg, norm_eps=1e-6)
    assert rel_err(normed, skinny_linear_ref(x, w, norm_eps=1e-6)) < tol
    act = skinny_linear_triton(x, w, config=cfg, silu=True)
    assert rel_err(act, skinny_linear_ref(x, w, silu=True)) < 2 * tol
    residual = _rand(gen, m, n, dtype=torch.bfloat16).cuda()
    expected = residual + skinny_linear_triton(x, w, config=cfg)
    skinny_linear_triton(x, w, config=cfg, residual=residual)
    assert torch.equal(residual, expected)
    eager = skinny_linear_triton(x, w, config=cfg, norm_eps=1e-6)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = skinny_linear_triton(x, w, config=cfg, norm_eps=1e-6)
    for _ in range(3):
        graph.replay()
        assert torch.equal(captured, eager)


def test_stream_k_where_one_program_per_tile_leaves_multiprocessors_idle():
    """The split for under-filled waves of long rows (docs/benchmarks.md, sixth session's sweep), not
    for nearly full waves, short rows, or the many-tile projections."""
    assert default_config(5120, 17408).stream_k  # Qwen3-14B down: 80 tiles for 132 SMs
    assert default_config(576, 7168) == SkinnyConfig(32, 256, num_stages=5, stream_k=True)  # kv_a
    assert not default_config(7168, 5120).stream_k  # q|k|v: 112 tiles, 85% of a wave
    assert not default_config(7168, 2048).stream_k  # DeepSeek shared down: K too short
    assert not default_config(34816, 5120).stream_k
    assert default_config(7168, 5120, sms=78).stream_k  # the same q|k|v over 78 SMs: 72% of two waves


def test_short_rows_past_one_wave_take_narrower_loads():
    """K <= 2048 with more tiles than multiprocessors: 128-column loads, so programs share one (the 35B-A3B
    shape's sweep); one wave of short rows, and longer rows, keep 256."""
    assert default_config(12352, 2048) == SkinnyConfig(64, 128)  # 35B-A3B GDN in_proj: 193 tiles
    assert default_config(9216, 2048) == SkinnyConfig(64, 128)  # its attention q|gate|k|v: 144
    assert default_config(7168, 2048) == SkinnyConfig(64, 256)  # DeepSeek shared down: 112
    assert default_config(12352, 4096) == SkinnyConfig(64, 256, stream_k=True)  # 9B GDN in_proj (K 4096)


@pytest.mark.parametrize("config", [SkinnyConfig(32, 64), STREAM_K_WHOLE_AND_SPLIT, None], ids=str)
def test_fp32_weight_upcasts_16_bit_x(config):
    """A router's logits: bf16 x against an fp32 w gives ``F.linear(x.float(), w)`` in fp32."""
    gen = torch.Generator().manual_seed(13)
    x, w = _rand(gen, 3, 256, dtype=torch.bfloat16), _rand(gen, 96, 256, dtype=torch.float32)
    got = skinny_linear_triton(x, w, config=config)
    assert got.dtype == torch.float32
    assert rel_err(got, x.float() @ w.T) < 1e-5
    assert torch.equal(skinny_linear_ref(x, w), torch.nn.functional.linear(x.float(), w))
    with pytest.raises(ValueError, match="fp32 w"):
        skinny_linear_triton(x.float(), w.to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize(("n", "k"), [(40, 2048), (33, 6144)], ids=["one-split-ragged", "three-splits"])
def test_gemv_preload_matches_the_reference(dtype, residual, n, k):
    """The preloading single-row GEMV (whole slices of w per program, split partials summed by the tile's
    last program), plain and adding into the residual stream in place; twice, so the tiles' counters were
    reset by the first launch."""
    gen = torch.Generator().manual_seed(n + k)
    x, w = _rand(gen, 1, k, dtype=dtype), _rand(gen, n, k, dtype=dtype)
    res = _rand(gen, 1, n, dtype=dtype) if residual else None
    want = skinny_linear_ref(x, w, residual=None if res is None else res.clone())
    for _ in range(2):
        into = None if res is None else res.clone()
        got = gemv_preload_triton(x, w, residual=into)
        if into is not None:
            assert got.data_ptr() == into.data_ptr()
        assert got.shape == want.shape
        assert rel_err(got, want) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_gemv_preload_applies_a_gated_norm(dtype, residual, monkeypatch):
    """With ``gated`` the row is a linear-attention output before its gated RMSNorm (heads of 128, z a
    strided view of a wider row): the result is the GEMV of the separately normed row (the prologue
    rounds where the norm does; the sums of squares may round apart by an ulp); two slices, so each
    program norms its own heads."""
    gen = torch.Generator().manual_seed(8)
    k, n, d = 4096, 48, 128
    o = _rand(gen, 1, k, dtype=dtype) * torch.linspace(0.2, 6.0, k).to(dtype).to(DEVICE)
    packed = _rand(gen, 1, 3 * k, dtype=dtype)  # [.., z, ..]: z a view with a row stride
    gated = GatedNorm(packed[:, k : 2 * k], 1.0 + 0.2 * _rand(gen, d, dtype=dtype), 1e-6)
    w = _rand(gen, n, k, dtype=dtype)
    res = _rand(gen, 1, n, dtype=dtype) if residual else None
    normed = rms_norm_gated(o, gated.z, gated.weight, 1e-6)
    heads = o.float().view(k // d, d)
    plain = heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + 1e-6) * gated.weight.float()
    plain = plain * torch.nn.functional.silu(gated.z.float().view(k // d, d))
    assert rel_err(normed, plain.view(1, k).to(dtype)) < TOL[dtype]
    want = gemv_preload_triton(normed, w, residual=None if res is None else res.clone())
    got = gemv_preload_triton(o, w, residual=None if res is None else res.clone(), gated=gated)
    assert rel_err(got, want) < TOL[dtype] / 4
    ref = skinny_linear_ref(o, w, gated=gated, residual=None if res is None else res.clone())
    assert rel_err(got, ref) < TOL[dtype]
    monkeypatch.setattr(skinny_gemm, "takes_preload", lambda x, w: x.numel() == x.shape[-1])
    into = None if res is None else res.clone()
    assert torch.equal(skinny_linear_triton(o, w, gated=gated, residual=into), got)
    with pytest.raises(ValueError, match="gated norm"):
        skinny_linear_triton(o, w, gated=gated, norm_eps=1e-6)
    with pytest.raises(ValueError, match="gated norm"):
        gemv_preload_triton(o, w, gated=GatedNorm(gated.z, gated.weight[:96], 1e-6))  # heads straddle slices


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gemv_preload_applies_a_row_norm(dtype):
    """With ``row_norm`` the row is a residual stream before a zero-centred RMSNorm (a MoE block's, whose
    router takes it): the normed row is written (as the norm's own kernel rounds it, up to an ulp where
    the sum of squares rounds apart) and the GEMV is that row's; one slice wide only."""
    gen = torch.Generator().manual_seed(9)
    k, n = 2048, 257
    x = 3 * _rand(gen, 1, k, dtype=dtype) + 0.5
    norm = RowNorm(
        0.2 * _rand(gen, k, dtype=dtype), 1e-6, torch.full((1, k), 7.0, dtype=dtype, device=DEVICE)
    )
    w = _rand(gen, n, k, dtype=dtype)
    x32 = x.float()
    want = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + norm.weight.float())).to(dtype)
    got = gemv_preload_triton(x, w, row_norm=norm)
    _ulp_close(norm.out, want)
    assert rel_err(got, gemv_preload_triton(want, w)) < TOL[dtype] / 4
    assert rel_err(got, skinny_linear_ref(want, w)) < TOL[dtype]
    with pytest.raises(ValueError, match="row norm"):
        gemv_preload_triton(
            _rand(gen, 1, 4096, dtype=dtype), _rand(gen, 16, 4096, dtype=dtype), row_norm=norm
        )
    with pytest.raises(ValueError, match="row norm"):
        gemv_preload_triton(x, w, row_norm=RowNorm(norm.weight, 1e-6, norm.out[:, :100]))


def test_preload_fits_only_weights_whose_programs_are_resident_at_once():
    # Qwen3.5-35B-A3B's out_proj (2048 x 4096): 128 tiles x 2 splits on 132 multiprocessors, two each.
    assert preload_fits(2048, 4096, 2, 132)
    assert not preload_fits(4096, 4096, 2, 132)  # the 9B's: 512 programs
    assert not preload_fits(2048, 3072, 2, 132)  # columns not whole slices
    assert not preload_fits(2048, 4096, 4, 132)  # fp32 slices would not fit the registers
