"""The Gated DeltaNet kernels (``gdn_kernels``) against the torch reference (``decode_reference``, the code
the CPU path runs) on fresh random inputs; the prefill kernels against decoding the segments token by token.

Without a GPU they run through Triton's interpreter on CPU tensors (the conftest selects it) at small
shapes; with one, the same cases run compiled, and the ``gpu``-marked ones at Qwen3.5-9B's real shape
(16 key heads, 32 value heads of 128) and inside a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

from pegainfer.testing.triton_kernels import KERNEL_DEVICE, requires_kernels
from pegainfer_qwen35 import gdn_kernels
from pegainfer_qwen35.gated_deltanet import decode_reference

DEVICE = KERNEL_DEVICE
pytestmark = requires_kernels


class Case:
    """Random inputs of one decode step: B rows of a layer with hk/hv heads over a pool of slots."""

    def __init__(self, rows, hk, hv, dk, dv, dtype, slots, kernel=4, seed=0, num_slots=None, device=DEVICE):
        gen = torch.Generator().manual_seed(seed)
        self.hk, self.hv, self.dk, self.dv, self.dtype = hk, hv, dk, dv, dtype
        conv_dim = 2 * hk * dk + hv * dv
        num_slots = num_slots or max(slots) + 2

        def rand(*shape, scale=1.0, dt=dtype):
            return (torch.randn(*shape, generator=gen) * scale).to(dt).to(device)

        # The packed projection [q|k|v, z, b, a], sliced as the module slices it (strided views).
        self.proj = rand(rows, conv_dim + hv * dv + 2 * hv)
        self.mixed, self.z, self.b, self.a = self.proj.split([conv_dim, hv * dv, hv, hv], dim=-1)
        self.conv_weight = rand(conv_dim, kernel, scale=0.5)
        self.a_log = rand(hv, scale=0.5)
        self.dt_bias = rand(hv, scale=0.5)
        self.norm = (1.0 + torch.randn(dv, generator=gen) * 0.1).to(dtype).to(device)
        # Windows hold model-dtype values (stored exactly in fp32), the state any fp32.
        self.windows = rand(num_slots, conv_dim, kernel - 1).float()
        self.ssm = rand(num_slots, hv, dk, dv, scale=0.3, dt=torch.float32)
        self.slots = torch.tensor(slots, dtype=torch.int64, device=device)

    def reference(self, rows=None):
        windows, ssm = self.windows.clone(), self.ssm.clone()
        r = slice(None) if rows is None else rows
        n = self.mixed[r].shape[0]
        conv = torch.empty_like(self.mixed[r])
        out = torch.empty(n, self.hv * self.dv, dtype=self.dtype, device=self.mixed.device)
        decode_reference(
            self.mixed[r], self.z[r], self.b[r], self.a[r], self.conv_weight, self.a_log, self.dt_bias,
            self.norm, windows, ssm, self.slots[r], conv, out, num_key_heads=self.hk, eps=1e-6,
        )  # fmt: skip
        return conv, out, windows, ssm

    def kernels(self, block_v=None):
        windows, ssm = self.windows.clone(), self.ssm.clone()
        conv = torch.empty_like(self.mixed)
        out = torch.empty(self.mixed.shape[0], self.hv * self.dv, dtype=self.dtype, device=self.mixed.device)
        gdn_kernels.conv_update(self.mixed, self.conv_weight, windows, self.slots, conv)
        gdn_kernels.gdn_decode(
            conv, self.b, self.a, self.z, self.a_log, self.dt_bias, self.norm, ssm, self.slots, out,
            num_key_heads=self.hk, eps=1e-6, block_v=self.dv if block_v == "head" else block_v,
        )  # fmt: skip
        return conv, out, windows, ssm


def _close(got, ref, dtype):
    # bf16 outputs: one ulp where a rounding flips (the kernel's fp32 sums run in another order).
    tol = {torch.float32: 2e-5, torch.bfloat16: 2**-7}[dtype]
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block_v", [None, "head", 8], ids=["default-tiles", "fused-norm", "split-v"])
@pytest.mark.parametrize("state_early", [False, True], ids=["state-after-wait", "state-early"])
def test_decode_step_matches_reference(dtype, block_v, state_early, monkeypatch):
    monkeypatch.setattr(gdn_kernels, "GDN_STATE_EARLY", state_early)
    case = Case(rows=3, hk=2, hv=4, dk=16, dv=32, dtype=dtype, slots=[3, 0, 5], seed=1)
    conv, out, windows, ssm = case.kernels(block_v)
    ref_conv, ref_out, ref_windows, ref_ssm = case.reference()
    _close(conv, ref_conv, dtype)
    torch.testing.assert_close(windows, ref_windows, rtol=0, atol=0)  # exact: a shift of stored inputs
    torch.testing.assert_close(ssm, ref_ssm, rtol=1e-5, atol=1e-5)
    _close(out, ref_out, dtype)
    untouched = [s for s in range(case.ssm.shape[0]) if s not in (3, 0, 5)]
    assert torch.equal(ssm[untouched], case.ssm[untouched]), "only the rows' slots may change"
    assert torch.equal(windows[untouched], case.windows[untouched])


def test_decode_tiles_split_the_heads_only_below_one_wave():
    """A batch whose (row, head) programs fill under one wave of multiprocessors takes narrow programs (the
    norm after); a full one keeps whole heads with the gated norm fused in."""
    assert gdn_kernels.decode_tiles(1, 32, 128, sms=132) == (16, 1)
    assert gdn_kernels.decode_tiles(64, 32, 128, sms=132) == (128, 4)
    assert gdn_kernels.decode_tiles(1, 4, 8, sms=132) == (8, 1)


def test_consecutive_steps_carry_the_state():
    """Three steps in place equal three reference steps (the windows and the state roll on)."""
    case = Case(rows=2, hk=1, hv=2, dk=16, dv=16, dtype=torch.float32, slots=[1, 2], kernel=3, seed=2)
    ref = Case(rows=2, hk=1, hv=2, dk=16, dv=16, dtype=torch.float32, slots=[1, 2], kernel=3, seed=2)
    for step in range(3):
        gen = torch.Generator().manual_seed(10 + step)
        fresh = torch.randn(case.proj.shape, generator=gen).to(DEVICE)
        case.proj.copy_(fresh)
        ref.proj.copy_(fresh)
        _, out, case.windows, case.ssm = case.kernels()
        _, ref_out, ref.windows, ref.ssm = ref.reference()
        _close(out, ref_out, torch.float32)
    torch.testing.assert_close(case.ssm, ref.ssm, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(case.windows, ref.windows, rtol=0, atol=0)


def test_padding_rows_update_row_zeros_slot_once():
    """A CUDA-graph bucket pads by replicating row 0: its slot must be updated once, as without padding;
    a negative slot is skipped altogether. The reference over the padded rows follows the same rule (the
    padding rows read zeros), output for output."""
    case = Case(rows=5, hk=2, hv=4, dk=16, dv=16, dtype=torch.float32, slots=[2, 4, 2, 2, -1], seed=3)
    case.proj[2:4].copy_(case.proj[0:1].expand(2, -1))  # the padding rows carry row 0's inputs
    conv, out, windows, ssm = case.kernels()
    ref_conv, ref_out, ref_windows, ref_ssm = case.reference(slice(0, 2))
    torch.testing.assert_close(ssm, ref_ssm, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(windows, ref_windows, rtol=0, atol=0)
    _close(out[:2], ref_out, torch.float32)
    _close(conv[:2], ref_conv, torch.float32)
    assert torch.isfinite(out).all()
    padded_conv, padded_out, padded_windows, padded_ssm = case.reference()
    _close(out, padded_out, torch.float32)
    _close(conv, padded_conv, torch.float32)
    torch.testing.assert_close(padded_ssm, ref_ssm, rtol=0, atol=0)
    torch.testing.assert_close(padded_windows, ref_windows, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gated_norm_kernel_matches_reference(dtype):
    from pegainfer_qwen35.norms import gated_rms_norm

    gen = torch.Generator().manual_seed(4)
    x = torch.randn(5, 3, 32, generator=gen).to(dtype).to(DEVICE)
    z = torch.randn(5, 96 + 7, generator=gen).to(dtype).to(DEVICE)[:, :96].view(5, 3, 32)
    w = (1 + 0.1 * torch.randn(32, generator=gen)).to(dtype).to(DEVICE)
    out = torch.empty(5, 96, dtype=dtype, device=DEVICE)
    gdn_kernels.gated_rms_norm(x, z, w, 1e-6, out)
    _close(out.view(5, 3, 32), gated_rms_norm(x, z, w, 1e-6), dtype)


def _prefill(case, lengths, slots, block_v=None, checkpoints=None, snapshots=None):
    """conv_prefill + gdn_prefill over segments of ``lengths`` rows of ``case``, from copies of its pools.
    ``checkpoints``: (tokens, first snapshot slot, count) per segment; then also returns the snapshot pools
    (``snapshots`` slots, as many as the state pools by default; filled with -7 before)."""
    windows, ssm = case.windows.clone(), case.ssm.clone()
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64, device=DEVICE)
    slots = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
    conv = torch.empty_like(case.mixed)
    out = torch.empty(case.mixed.shape[0], case.hv * case.dv, dtype=case.dtype, device=DEVICE)
    conv_ckpt = ssm_ckpt = None
    if checkpoints is not None:
        tokens, snaps, counts = torch.tensor(checkpoints, dtype=torch.int64, device=DEVICE).t().contiguous()
        n = snapshots or windows.shape[0]
        conv_pool = torch.full((n, *windows.shape[1:]), -7.0, device=DEVICE)
        ssm_pool = torch.full((n, *ssm.shape[1:]), -7.0, device=DEVICE)
        conv_ckpt = gdn_kernels.Checkpoints(tokens, snaps, counts, conv_pool)
        ssm_ckpt = gdn_kernels.Checkpoints(tokens, snaps, counts, ssm_pool)
    gdn_kernels.conv_prefill(case.mixed, case.conv_weight, windows, slots, cu, conv, checkpoints=conv_ckpt)
    gdn_kernels.gdn_prefill(
        conv, case.b, case.a, case.z, case.a_log, case.dt_bias, case.norm, ssm, slots, cu, out,
        num_key_heads=case.hk, eps=1e-6, block_v=block_v, checkpoints=ssm_ckpt,
    )  # fmt: skip
    if checkpoints is not None:
        return conv, out, windows, ssm, conv_ckpt.pool, ssm_ckpt.pool
    return conv, out, windows, ssm


def _token_by_token(case, lengths, slots, states=None):
    """The oracle of the prefill kernels: each segment decoded one token at a time by the reference.
    ``states`` (a list): gets per segment its (window, state) after 0, 1, ..., all of its tokens."""
    windows, ssm = case.windows.clone(), case.ssm.clone()
    conv = torch.empty_like(case.mixed)
    out = torch.empty(case.mixed.shape[0], case.hv * case.dv, dtype=case.dtype, device=DEVICE)
    row = 0
    for n, slot in zip(lengths, slots, strict=True):
        index = torch.tensor([max(slot, 0)], dtype=torch.int64, device=DEVICE)
        w, s = (windows, ssm) if slot >= 0 else (torch.zeros_like(windows), torch.zeros_like(ssm))
        after = [(w[index[0]].clone(), s[index[0]].clone())]
        for t in range(row, row + n):
            decode_reference(
                case.mixed[t : t + 1], case.z[t : t + 1], case.b[t : t + 1], case.a[t : t + 1], case.conv_weight,
                case.a_log, case.dt_bias, case.norm, w, s, index, conv[t : t + 1], out[t : t + 1],
                num_key_heads=case.hk, eps=1e-6,
            )  # fmt: skip
            after.append((w[index[0]].clone(), s[index[0]].clone()))
        if states is not None:
            states.append(after)
        row += n
    return conv, out, windows, ssm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block_v", [None, 8], ids=["fused-norm", "split-v"])
def test_prefill_kernels_equal_decoding_token_by_token(dtype, block_v):
    """Segments longer and shorter than the conv window and than a conv tile (32 tokens), one of one
    token, from their slots' windows and states; the slots of no segment stay as they were."""
    lengths, slots = [5, 1, 40, 2], [3, 0, 5, 1]
    case = Case(rows=sum(lengths), hk=2, hv=4, dk=16, dv=32, dtype=dtype, slots=slots, seed=4, num_slots=7)
    conv, out, windows, ssm = _prefill(case, lengths, slots, block_v)
    ref_conv, ref_out, ref_windows, ref_ssm = _token_by_token(case, lengths, slots)
    _close(conv, ref_conv, dtype)
    torch.testing.assert_close(windows, ref_windows, rtol=0, atol=0)
    torch.testing.assert_close(ssm, ref_ssm, rtol=1e-5, atol=1e-5)
    _close(out, ref_out, dtype)
    untouched = [2, 4, 6]
    assert torch.equal(ssm[untouched], case.ssm[untouched])
    assert torch.equal(windows[untouched], case.windows[untouched])


@pytest.mark.parametrize("block_v", [None, 8], ids=["fused-norm", "split-v"])
def test_prefill_kernels_save_runs_of_checkpoints_inside_segments(block_v):
    """For j < count, a segment's window and state after its first tokens + j tokens go into snapshot
    slot + j: what decoding just those tokens leaves in its slot. Runs of 1, 2 and 3 saves, one from
    before the segment (tokens 0, the window then still its old inputs), one ending at the segment's end,
    one clipped there, one across a conv tile (32 tokens), one in a segment without a state slot (from
    zeros), and none for a segment with tokens -1 (whatever its count). The rest of the forward is as without checkpoints, and no other
    snapshot slot is written."""
    lengths = [5, 6, 2, 9, 3, 35, 4]
    slots = [3, 0, 5, 1, 6, 2, -1]
    checkpoints = [(2, 0, 3), (-1, 14, 3), (1, 3, 2), (8, 5, 3), (0, 8, 2), (31, 10, 3), (3, 13, 1)]
    saved = {0: (0, 2), 1: (0, 3), 2: (0, 4), 3: (2, 1), 4: (2, 2), 5: (3, 8), 6: (3, 9), 8: (4, 0)}
    saved |= {9: (4, 1), 10: (5, 31), 11: (5, 32), 12: (5, 33), 13: (6, 3)}  # snapshot: (segment, tokens)
    case = Case(
        rows=sum(lengths), hk=2, hv=4, dk=16, dv=32, dtype=torch.float32, slots=slots, seed=6, num_slots=7
    )
    conv, out, windows, ssm, snap_windows, snap_ssm = _prefill(
        case, lengths, slots, block_v, checkpoints, snapshots=17
    )
    plain = _prefill(case, lengths, slots, block_v)
    for got, want in zip((conv, out, windows, ssm), plain, strict=True):
        assert torch.equal(got, want)
    states: list = []
    _token_by_token(case, lengths, slots, states)
    for snap, (segment, tokens) in saved.items():
        ref_window, ref_state = states[segment][tokens]
        torch.testing.assert_close(snap_windows[snap], ref_window, rtol=0, atol=0)
        torch.testing.assert_close(snap_ssm[snap], ref_state, rtol=1e-5, atol=1e-5)
    unwritten = [snap for snap in range(17) if snap not in saved]  # 7: the save past segment 3's end
    assert (snap_windows[unwritten] == -7.0).all() and (snap_ssm[unwritten] == -7.0).all()


def test_checkpoints_need_a_count_per_segment():
    case = Case(rows=4, hk=1, hv=2, dk=16, dv=16, dtype=torch.float32, slots=[0, 1], kernel=3, seed=7)
    tokens = torch.tensor([1, 2], device=DEVICE)
    short = gdn_kernels.Checkpoints(tokens, tokens, tokens[:1], case.windows.clone())
    cu = torch.tensor([0, 2, 4], device=DEVICE)
    with pytest.raises(ValueError, match="counts"):
        gdn_kernels.conv_prefill(
            case.mixed, case.conv_weight, case.windows.clone(), case.slots, cu, torch.empty_like(case.mixed),
            checkpoints=short,
        )  # fmt: skip


def test_prefill_segment_without_a_slot_starts_from_zeros_and_writes_nothing():
    lengths, slots = [3, 4], [-1, 2]
    case = Case(rows=7, hk=1, hv=2, dk=16, dv=16, dtype=torch.float32, slots=[0, 2], kernel=3, seed=5)
    conv, out, windows, ssm = _prefill(case, lengths, slots)
    ref_conv, ref_out, ref_windows, ref_ssm = _token_by_token(case, lengths, slots)
    _close(conv, ref_conv, torch.float32)
    _close(out, ref_out, torch.float32)
    torch.testing.assert_close(ssm, ref_ssm, rtol=1e-5, atol=1e-5)
    assert torch.equal(windows, ref_windows) and torch.equal(ssm[0], case.ssm[0])


# ------------------------------------------------------------------------------------------ on the GPU

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("rows", [1, 16, 64])
@pytest.mark.parametrize("block_v", [None, "head", 32], ids=["default-tiles", "fused-norm", "split-v"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_qwen35_9b_shape_on_gpu(rows, block_v, dtype):
    slots = torch.randperm(2 * rows + 3, generator=torch.Generator().manual_seed(rows))[:rows].tolist()
    case = Case(rows, hk=16, hv=32, dk=128, dv=128, dtype=dtype, slots=slots, seed=rows)
    conv, out, windows, ssm = case.kernels(block_v)
    ref_conv, ref_out, ref_windows, ref_ssm = case.reference()
    _close(conv, ref_conv, dtype)
    torch.testing.assert_close(windows, ref_windows, rtol=0, atol=0)
    torch.testing.assert_close(ssm, ref_ssm, rtol=1e-4, atol=1e-4)
    # bf16 output: the gated norm amplifies a one-ulp flip of o; nearly every element still agrees.
    tol = {torch.float32: 1e-4, torch.bfloat16: 2**-6}[dtype]
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=tol, atol=tol)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_prefill_kernels_qwen35_9b_shape_on_gpu(dtype):
    lengths, slots = [64, 1, 17, 128], [4, 0, 7, 2]
    case = Case(sum(lengths), hk=16, hv=32, dk=128, dv=128, dtype=dtype, slots=slots, seed=9, num_slots=9)
    conv, out, windows, ssm = _prefill(case, lengths, slots)
    ref_conv, ref_out, ref_windows, ref_ssm = _token_by_token(case, lengths, slots)
    _close(conv, ref_conv, dtype)
    torch.testing.assert_close(windows, ref_windows, rtol=0, atol=0)
    torch.testing.assert_close(ssm, ref_ssm, rtol=1e-4, atol=1e-4)
    tol = {torch.float32: 1e-4, torch.bfloat16: 2**-6}[dtype]
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=tol, atol=tol)


@pytest.mark.gpu
@needs_gpu
def test_decode_kernels_replay_in_a_cuda_graph():
    """Captured once, replayed over new inputs and new slots written into the same tensors: each replay
    equals the reference of that step (the slots are read on the device, the state updated in place)."""
    case = Case(16, hk=16, hv=32, dk=128, dv=128, dtype=torch.bfloat16, slots=list(range(16)), seed=7)
    conv = torch.empty_like(case.mixed)
    out = torch.empty(16, 32 * 128, dtype=torch.bfloat16, device="cuda")

    def step():
        gdn_kernels.conv_update(case.mixed, case.conv_weight, case.windows, case.slots, conv)
        gdn_kernels.gdn_decode(
            conv, case.b, case.a, case.z, case.a_log, case.dt_bias, case.norm, case.ssm, case.slots, out,
            num_key_heads=16, eps=1e-6,
        )  # fmt: skip

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    saved = case.windows.clone(), case.ssm.clone()
    with torch.cuda.stream(stream):
        step()  # compile outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    case.windows.copy_(saved[0])
    case.ssm.copy_(saved[1])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    case.windows.copy_(saved[0])
    case.ssm.copy_(saved[1])
    gen = torch.Generator().manual_seed(8)
    for _ in range(3):
        case.proj.copy_(torch.randn(case.proj.shape, generator=gen).to(torch.bfloat16))
        case.slots.copy_(torch.randperm(case.ssm.shape[0], generator=gen)[:16])
        _, ref_out, ref_windows, ref_ssm = case.reference()
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(case.ssm, ref_ssm, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(case.windows, ref_windows, rtol=0, atol=0)
        torch.testing.assert_close(out.float(), ref_out.float(), rtol=2**-6, atol=2**-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_zero_centred_norm_kernel_matches_reference(dtype):
    """Plain rows, and per-head rows of strided views (the attention's query inside [query | gate])."""
    from pegainfer_qwen35.norms import rms_norm_zero_centred_ref

    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(4, 48, generator=gen) * 3).to(dtype).to(DEVICE)
    w = (0.1 * torch.randn(48, generator=gen)).to(dtype).to(DEVICE)
    out = torch.empty_like(x)
    gdn_kernels.rms_norm_zero_centred(x, w, 1e-6, out)
    _close(out, rms_norm_zero_centred_ref(x, w, 1e-6), dtype)
    packed = torch.randn(4, 3, 2 * 16, generator=gen).to(dtype).to(DEVICE)
    query = packed[..., :16]  # strides (96, 32, 1)
    wq = (0.1 * torch.randn(16, generator=gen)).to(dtype).to(DEVICE)
    _close(
        gdn_kernels.rms_norm_zero_centred(query, wq, 1e-6), rms_norm_zero_centred_ref(query, wq, 1e-6), dtype
    )
