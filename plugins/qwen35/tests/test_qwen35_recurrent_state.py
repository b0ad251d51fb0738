"""The Gated DeltaNet state: its math (chunked form = step form = transformers), and the engine's handling
of it (one chunk = several chunks = prefill + decode, read from the BufferManager's slot pools; decode
rows of a step batched into one recurrent update)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from pegainfer import LLM, SamplingParams
from pegainfer.engine.request import Request
from pegainfer.executor.executor import ModelBatch, SequenceChunk
from pegainfer.testing.triton_kernels import KERNEL_DEVICE, requires_kernels
from pegainfer_qwen35 import gated_deltanet
from pegainfer_qwen35.delta_rule import (
    causal_conv_prefill,
    causal_conv_step,
    chunked_delta_rule,
    l2_normalise,
    recurrent_delta_rule,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _inputs(seed: int, t: int, hk: int = 2, hv: int = 4, dk: int = 16, dv: int = 24):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(t, hk, dk, generator=gen), torch.randn(t, hk, dk, generator=gen)
    v = torch.randn(t, hv, dv, generator=gen)
    g = -torch.rand(t, hv, generator=gen) * 0.8
    beta = torch.rand(t, hv, generator=gen)
    state = 0.3 * torch.randn(hv, dk, dv, generator=gen)
    return q, k, v, g, beta, state


def _expand(q: torch.Tensor, k: torch.Tensor, hv: int) -> tuple[torch.Tensor, torch.Tensor]:
    r = hv // q.shape[1]
    q = l2_normalise(q) * q.shape[-1] ** -0.5
    return q.repeat_interleave(r, dim=1), l2_normalise(k).repeat_interleave(r, dim=1)


@pytest.mark.parametrize("t", [1, 37, 64, 150])
def test_chunked_delta_rule_equals_step_by_step_and_transformers(t):
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    q, k, v, g, beta, state = _inputs(t, t)
    qe, ke = _expand(q, k, v.shape[1])
    o, final = chunked_delta_rule(qe, ke, v, g, beta, state)
    o_steps, final_steps = recurrent_delta_rule(qe, ke, v, g, beta, state)
    torch.testing.assert_close(o, o_steps, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(final, final_steps, atol=2e-6, rtol=1e-5)
    o_hf, final_hf = torch_chunk_gated_delta_rule(
        q[None], k[None], v[None], g=g[None], beta=beta[None], initial_state=state[None],
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    torch.testing.assert_close(o, o_hf[0], atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(final, final_hf[0], atol=2e-6, rtol=1e-5)


def test_chunked_delta_rule_carries_state_across_calls():
    q, k, v, g, beta, state = _inputs(1, 100)
    qe, ke = _expand(q, k, v.shape[1])
    whole, final = chunked_delta_rule(qe, ke, v, g, beta, state)
    parts, s = [], state
    for a, b in ((0, 3), (3, 70), (70, 71), (71, 100)):
        o, s = chunked_delta_rule(qe[a:b], ke[a:b], v[a:b], g[a:b], beta[a:b], s)
        parts.append(o)
    torch.testing.assert_close(torch.cat(parts), whole, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(s, final, atol=2e-6, rtol=1e-5)


def test_causal_conv_window_rolls_across_chunks_and_steps():
    gen = torch.Generator().manual_seed(0)
    channels, kernel, t = 6, 4, 11
    x, weight = torch.randn(t, channels, generator=gen), torch.randn(channels, kernel, generator=gen)
    reference = F.conv1d(x.t()[None], weight[:, None], padding=kernel - 1, groups=channels)[0, :, :t].t()
    window = torch.zeros(channels, kernel - 1)
    outs = []
    for a, b in ((0, 2), (2, 3), (3, 9)):  # chunks shorter than the window keep old inputs in it
        y, window = causal_conv_prefill(x[a:b], weight, window)
        outs.append(y)
    for i in (9, 10):  # then single steps of a batch of one
        y, windows = causal_conv_step(x[i : i + 1], weight, window[None])
        outs.append(y)
        window = windows[0]
    torch.testing.assert_close(torch.cat(outs), reference)
    torch.testing.assert_close(window, x[-(kernel - 1) :].t())


# ------------------------------------------------------------------------------------ through the engine


@pytest.fixture(scope="module")
def llm(tiny_checkpoint_factory):
    return LLM(
        str(tiny_checkpoint_factory("qwen3_5")), dtype="float32", device="cpu", cpu_kv_cache_bytes=4 << 20
    )


def _prefill_in_chunks(
    llm: LLM, rid: str, prompt: list[int], sizes: list[int]
) -> dict[int, dict[str, torch.Tensor]]:
    """Runs ``prompt`` through the executor in chunks of ``sizes`` (1 = a decode row); returns the slot state."""
    engine = llm.engine
    buffers = engine.buffers
    request = Request(rid, prompt, GREEDY)
    start = 0
    try:
        for n in sizes:
            assert buffers.allocate_slots(request, n)
            chunk = SequenceChunk(
                rid,
                prompt[start : start + n],
                start,
                buffers.block_table(rid),
                state_slot=buffers.state_slot(rid),
                needs_logits=True,
            )
            engine.executor.execute(ModelBatch([chunk]))
            request.num_computed_tokens += n
            start += n
        assert start == len(prompt)
        slot = buffers.state_slot(rid)
        return {
            layer: {name: pool[slot].clone() for name, pool in pools.items()}
            for layer, pools in engine.executor.runner.buffers.states.items()
        }
    finally:
        buffers.free(request)


def test_state_after_one_chunk_equals_several_chunks_and_decode(llm):
    prompt = random.Random(5).choices(range(990), k=40)
    one = _prefill_in_chunks(llm, "one", prompt, [40])
    chunks = _prefill_in_chunks(llm, "chunks", prompt, [3, 5, 1, 7, 24])
    decoded = _prefill_in_chunks(llm, "decoded", prompt, [30] + [1] * 10)
    config = llm.engine.executor.runner.model.config
    gdn_layers = [i for i, t in enumerate(config.layer_types) if t == "linear_attention"]
    assert sorted(one) == gdn_layers  # only GDN layers hold slot state
    for layer in gdn_layers:
        assert one[layer]["conv"].shape == (config.conv_dim, config.conv_kernel - 1)
        assert one[layer]["ssm"].abs().max() > 0.01  # the state is not trivially zero
        for other in (chunks, decoded):
            for name in ("conv", "ssm"):
                torch.testing.assert_close(other[layer][name], one[layer][name], atol=1e-5, rtol=1e-5)


def test_decode_rows_update_their_slots_in_one_batched_step(llm, monkeypatch):
    calls: list[int] = []
    step = gated_deltanet.delta_rule_step

    def counting(q, *args):
        calls.append(q.shape[0])
        return step(q, *args)

    monkeypatch.setattr(gated_deltanet, "delta_rule_step", counting)
    prompts = [random.Random(i).choices(range(990), k=n) for i, n in enumerate((6, 9, 13))]
    single = [llm.generate(prompt_token_ids=[p], sampling_params=GREEDY, use_tqdm=False)[0] for p in prompts]
    calls.clear()
    batched = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in batched] == [o.outputs[0].token_ids for o in single]
    gdn_layers = llm.engine.executor.runner.model.config.layer_types.count("linear_attention")
    # One prefill step, then 7 decode steps of all three rows: one batched update per GDN layer per step.
    assert calls == [3] * (7 * gdn_layers)


@requires_kernels
def test_gated_norm_in_the_output_projection_equals_the_norm_launch(monkeypatch):
    """``NORM_IN_OUT_PROJECTION``: a one-row decode step whose delta-rule kernel leaves the gated norm to
    ``out_proj``'s single-row GEMV (16 value heads of 128: one 2048-column slice) adds the same to the
    residual and leaves the same slot state as the norm's own launch."""
    from pegainfer import ops
    from pegainfer.kernels import skinny_gemm
    from pegainfer_qwen35.pass_buffers import PassBuffers, pass_buffer_roles

    if KERNEL_DEVICE == "cpu":  # the interpreter on CPU tensors: take the CUDA branches anyway
        monkeypatch.setattr(ops, "use_triton", lambda t: True)
        monkeypatch.setattr(skinny_gemm, "takes_kernel", lambda x: True)
    monkeypatch.setattr(  # as on the GPU, where PDL is on
        skinny_gemm,
        "takes_preload",
        lambda x, w: x.numel() == x.shape[-1] and skinny_gemm.preload_fits(*w.shape, 2, 132),
    )
    monkeypatch.setattr(gated_deltanet, "decode_kernels_on", lambda x: True)
    layer = _gdn_layer(15, linear_value_head_dim=128, linear_key_head_dim=32, linear_num_value_heads=16)
    layer = layer.to(KERNEL_DEVICE, torch.bfloat16)
    gen = torch.Generator().manual_seed(16)
    x = torch.randn(1, layer.config.hidden_size, generator=gen).to(KERNEL_DEVICE, torch.bfloat16)
    residual = torch.randn(1, layer.config.hidden_size, generator=gen).to(KERNEL_DEVICE, torch.bfloat16)
    spec = dict(layer.state_spec().shapes)
    pools = {
        name: torch.randn(3, *shape, generator=gen).to(torch.bfloat16).float() for name, shape in spec.items()
    }
    dev = torch.device(KERNEL_DEVICE)
    rows = gated_deltanet.RecurrentRows(
        [], torch.zeros(0, dtype=torch.int64, device=dev), 0, 1, torch.tensor([2], device=dev)
    )
    outs, states = {}, {}
    for fused in (False, True):
        monkeypatch.setattr(gated_deltanet, "NORM_IN_OUT_PROJECTION", fused)
        state = {name: pool.to(dev, copy=True) for name, pool in pools.items()}
        bufs = PassBuffers(pass_buffer_roles(layer.config, torch.bfloat16), 1, dev)
        z = torch.zeros(1, layer.shard.value_dim, device=dev, dtype=torch.bfloat16)
        assert (layer._norm_in_out_projection(x, z, rows, residual, bufs.gdn_gated) is not None) == fused
        # Never without the residual add (a tensor-parallel partial), nor for two rows.
        assert layer._norm_in_out_projection(x, z, rows, None, bufs.gdn_gated) is None
        two = gated_deltanet.RecurrentRows([], rows.segment_slots, 0, 2, torch.tensor([2, 1], device=dev))
        pair = PassBuffers(pass_buffer_roles(layer.config, torch.bfloat16), 2, dev)
        assert (
            layer._norm_in_out_projection(x.repeat(2, 1), z.repeat(2, 1), two, residual, pair.gdn_gated)
            is None
        )
        with torch.no_grad():
            outs[fused] = layer(x, rows, state, bufs, residual=residual.clone()).float().cpu()
        states[fused] = {name: t.cpu() for name, t in state.items()}
    assert not torch.equal(outs[False], residual.float().cpu())
    # Equal bit for bit in the interpreter; compiled, a head's sum of squares may round apart.
    torch.testing.assert_close(outs[True], outs[False], atol=2e-2, rtol=8e-3)
    for name in spec:
        torch.testing.assert_close(states[True][name], states[False][name], atol=0, rtol=0)


def _fla_semantics(
    q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, cu_seqlens_cpu,
    use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel,
):  # fmt: skip
    """fla's ``chunk_gated_delta_rule`` as documented (varlen batch of 1; fewer q/k heads than value heads,
    value head j reading q/k head j // (HV / H); q/k normalised, the gate ``-exp(A_log) * softplus(g +
    dt_bias)`` and ``sigmoid(beta)`` in the kernel; per-sequence initial and final states), in torch: what
    ``prefill_with_fla`` is written against."""
    assert q.shape[0] == 1 and output_final_state and use_qk_l2norm_in_kernel
    assert use_gate_in_kernel and use_beta_sigmoid_in_kernel
    assert cu_seqlens_cpu.device.type == "cpu" and cu_seqlens_cpu.tolist() == cu_seqlens.tolist()
    group = v.shape[2] // q.shape[2]
    q, k = (x.repeat_interleave(group, dim=2) for x in (q, k))
    g = -A_log.float().exp() * torch.nn.functional.softplus(g.float() + dt_bias)
    beta = torch.sigmoid(beta.float())
    bounds = cu_seqlens.tolist()
    outs, finals = [], []
    for i in range(len(bounds) - 1):
        a, b = bounds[i], bounds[i + 1]
        qs = l2_normalise(q[0, a:b].float()) * scale
        ks = l2_normalise(k[0, a:b].float())
        o, final = chunked_delta_rule(qs, ks, v[0, a:b].float(), g[0, a:b], beta[0, a:b], initial_state[i])
        outs.append(o)
        finals.append(final)
    return torch.cat(outs)[None].to(v.dtype), torch.stack(finals)


def test_prefill_with_fla_passes_segments_and_slots_as_fla_expects():
    """The varlen call's plumbing (cu_seqlens, the slots' states gathered and scattered, q/k heads
    grouped under the value heads) against the per-segment torch path, with a torch stand-in of fla's function."""
    from pegainfer_qwen35.gated_deltanet import RecurrentRows, gate_and_normalise, prefill_with_fla

    widths = gated_deltanet._Widths(2, 4, 16, 8)
    gen = torch.Generator().manual_seed(9)
    lengths, slots = [5, 70, 1], [2, 0, 3]
    p = sum(lengths)
    conv = torch.randn(p, widths.conv_dim, generator=gen)
    b, a = torch.randn(p, 4, generator=gen), torch.randn(p, 4, generator=gen)
    a_log, dt_bias = torch.randn(4, generator=gen) * 0.5, torch.randn(4, generator=gen) * 0.5
    ssm = torch.randn(5, 4, 16, 8, generator=gen) * 0.3
    starts = [0, 5, 75]
    rows = RecurrentRows(
        list(zip(starts, lengths, strict=True)), torch.tensor(slots), p, 0, torch.zeros(0, dtype=torch.int64)
    )
    ours_ssm, core = ssm.clone(), torch.empty(p, 4, 8)
    assert prefill_with_fla(conv, b, a, a_log, dt_bias, rows, ours_ssm, widths, core, rule=_fla_semantics)
    q, k, v, g, beta = gate_and_normalise(conv, b, a, a_log, dt_bias, widths)
    ref_ssm = ssm.clone()
    for (start, n), slot in rows.prefills():
        o, final = chunked_delta_rule(
            q[start : start + n], k[start : start + n], v[start : start + n], g[start : start + n],
            beta[start : start + n], ref_ssm[slot][0],
        )  # fmt: skip
        torch.testing.assert_close(core[start : start + n], o, atol=1e-5, rtol=1e-5)
        ref_ssm[slot] = final
    torch.testing.assert_close(ours_ssm, ref_ssm, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------- checkpoints in a prefill


def _gdn_layer(seed: int, **overrides):
    """A GDN layer of the tiny config (value heads of 16: the kernels need power-of-two widths), random."""
    from pegainfer_qwen35.config import LINEAR, Qwen35Config
    from pegainfer_qwen35.tiny import qwen3_5_config

    overrides = {"linear_value_head_dim": 16, **overrides}
    config = Qwen35Config.from_hf_config(qwen3_5_config(64, text_only=True, **overrides))
    layer = gated_deltanet.GatedDeltaNet(config, config.layers_of(LINEAR)[0], torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
        layer.norm.add_(1.0)
    return layer


def _gdn_prefill(layer, proj, lengths, slots, pools, checkpoints=None, snapshots=0):
    """``GatedDeltaNet._prefill_segments`` of the rows ``proj`` in segments of ``lengths`` from copies of ``pools``
    (the state slots), on the layer's device; ``checkpoints``: (tokens, snapshot slot, count) per segment,
    into ``snapshots`` fresh snapshot slots (-7 before). Returns the gated output, the state pools and the
    snapshot pools, on the host."""
    from pegainfer.model.model_api import StateCheckpoints
    from pegainfer_qwen35.pass_buffers import PassBuffers, pass_buffer_roles

    p, dev = proj.shape[0], layer.in_proj.device
    state = {name: pool.to(dev, copy=True) for name, pool in pools.items()}
    snaps = {name: torch.full((snapshots, *pool.shape[1:]), -7.0, device=dev) for name, pool in pools.items()}
    ckpt = None
    if checkpoints is not None:
        tokens, snap_slots, counts = torch.tensor(checkpoints, dtype=torch.int64, device=dev).t().contiguous()
        ckpt = StateCheckpoints(tokens, snap_slots, counts, list(checkpoints), {layer.layer_index: snaps})
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    rows = gated_deltanet.RecurrentRows(
        list(zip(starts, lengths, strict=True)), torch.tensor(slots, device=dev), p, 0,
        torch.zeros(0, dtype=torch.int64, device=dev), checkpoints=ckpt,
    )  # fmt: skip
    bufs = PassBuffers(pass_buffer_roles(layer.config, torch.float32), p, dev)
    mixed, z, b, a = proj.to(dev).split(layer.splits, dim=-1)
    layer._prefill_segments(mixed, z, b, a, rows, state, bufs)
    host = {
        name: {k: t.cpu() for k, t in pools.items()} for name, pools in (("state", state), ("snaps", snaps))
    }
    return bufs.gdn_gated.cpu(), host["state"], host["snaps"]


@pytest.mark.parametrize(
    "path", ["torch", pytest.param("kernels", marks=requires_kernels)], ids=["torch", "kernels"]
)
def test_prefill_saves_runs_of_checkpoints(path, monkeypatch):
    """For j < count the snapshots after a segment's first tokens + j tokens equal the state that
    prefilling just those tokens leaves (tokens + j = 0: the state before the segment), on the torch
    path (the segment cut into pieces at the saves, one across a chunk of the chunked form) and through
    the kernels (the counts passed on); no save past a segment's end, none for tokens -1, and the rest
    of the forward is as without checkpoints."""
    layer = _gdn_layer(11)  # the references' layer: the torch path, on the host
    lengths, slots = [5, 70, 4, 3, 6], [2, 0, 3, 1, 4]
    checkpoints = [(1, 0, 3), (63, 8, 3), (3, 3, 3), (0, 6, 2), (-1, 11, 2)]
    saved = {0: (0, 1), 1: (0, 2), 2: (0, 3), 8: (1, 63), 9: (1, 64), 10: (1, 65), 3: (2, 3), 4: (2, 4)}
    saved |= {6: (3, 0), 7: (3, 1)}  # snapshot slot: (segment, tokens); slot 5: the save past segment 2's end
    gen = torch.Generator().manual_seed(12)
    proj = torch.randn(sum(lengths), sum(layer.splits), generator=gen)
    spec = dict(layer.state_spec().shapes)
    pools = {name: torch.randn(6, *shape, generator=gen) * 0.3 for name, shape in spec.items()}
    with monkeypatch.context() as patch:
        tested = layer
        if path == "kernels":  # on the host through Triton's interpreter where there is no GPU
            patch.setattr(gated_deltanet, "decode_kernels_on", lambda x: True)
            tested = _gdn_layer(11).to(KERNEL_DEVICE)
        out, state, snaps = _gdn_prefill(tested, proj, lengths, slots, pools, checkpoints, snapshots=13)
    plain_out, plain_state, _ = _gdn_prefill(layer, proj, lengths, slots, pools)
    torch.testing.assert_close(out, plain_out, atol=1e-4, rtol=1e-4)
    for name in spec:
        torch.testing.assert_close(state[name], plain_state[name], atol=1e-5, rtol=1e-5)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    for snap, (segment, tokens) in saved.items():
        slot = slots[segment]
        if tokens == 0:
            want = {name: pool[slot] for name, pool in pools.items()}
        else:
            rows = proj[starts[segment] : starts[segment] + tokens]
            want = {
                name: pool[slot]
                for name, pool in _gdn_prefill(layer, rows, [tokens], [slot], pools)[1].items()
            }
        torch.testing.assert_close(snaps["conv"][snap], want["conv"], atol=0, rtol=0)
        torch.testing.assert_close(snaps["ssm"][snap], want["ssm"], atol=1e-5, rtol=1e-5)
    for name in spec:
        assert (snaps[name][[5, 11, 12]] == -7.0).all(), "only the saves' snapshot slots are written"


def test_prefill_parts_keep_long_unsaved_segments_apart_from_checkpointed_ones():
    """Runs of consecutive segments with and without saves become parts (rows re-based, checkpoints
    sliced) only where a long segment without saves would otherwise run token by token; a step without
    a long unsaved segment, or inside a CUDA graph, stays one part."""
    from pegainfer.model.model_api import StateCheckpoints

    long = gated_deltanet.RECURRENT_PREFILL_MAX_TOKENS + 1

    def rows(lengths, saves, in_graph=False):
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        host = [(t, 10 * i, 2 if t >= 0 else 0) for i, t in enumerate(saves)]
        tokens, slots, counts = torch.tensor(host, dtype=torch.int64).t().contiguous()
        ckpt = StateCheckpoints(tokens, slots, counts, host, {})
        return gated_deltanet.RecurrentRows(
            list(zip(starts, lengths, strict=True)), torch.arange(len(lengths)), sum(lengths), 0,
            torch.zeros(0, dtype=torch.int64), checkpoints=ckpt, in_graph=in_graph,
        )  # fmt: skip

    whole = rows([4, long, 3, 2, long], [1, -1, 0, 2, -1])
    parts = whole.prefill_parts
    assert [(lo, hi) for lo, hi, _ in parts] == [
        (0, 4),
        (4, 4 + long),
        (4 + long, 9 + long),
        (9 + long, 9 + 2 * long),
    ]
    assert [p.segments for _, _, p in parts] == [[(0, 4)], [(0, long)], [(0, 3), (3, 2)], [(0, long)]]
    assert [p.segment_slots.tolist() for _, _, p in parts] == [[0], [1], [2, 3], [4]]
    assert [p.checkpoints and p.checkpoints.host for _, _, p in parts] == [
        [(1, 0, 2)],
        None,
        [(0, 20, 2), (2, 30, 2)],
        None,
    ]
    assert parts[2][2].checkpoints.tokens.tolist() == [0, 2] and parts[2][2].cu_seqlens_cpu.tolist() == [
        0,
        3,
        5,
    ]
    for one in (
        rows([4, long - 1, 3], [1, -1, 0]),
        rows([4, long], [1, 5]),
        rows([4, long], [1, -1], in_graph=True),
    ):
        assert [(lo, hi, p) for lo, hi, p in one.prefill_parts] == [(0, one.decode_start, one)]


@pytest.mark.parametrize(
    "path", ["torch", pytest.param("kernels", marks=requires_kernels)], ids=["torch", "kernels"]
)
def test_a_long_chunk_beside_checkpoints_takes_the_chunked_form(path, monkeypatch):
    """A verification-like step (short segments saving checkpoints) beside a long prompt chunk without
    any: the long chunk goes through the chunked form (never the token-by-token kernel), the short ones
    through the kernels, and outputs, states and snapshots are those of running each segment alone."""
    from pegainfer_qwen35 import gdn_kernels

    long = gated_deltanet.RECURRENT_PREFILL_MAX_TOKENS + 2
    layer = _gdn_layer(13)
    lengths, slots = [3, long, 4], [1, 0, 3]
    checkpoints = [(0, 0, 3), (-1, 5, 1), (1, 3, 2)]
    gen = torch.Generator().manual_seed(14)
    proj = torch.randn(sum(lengths), sum(layer.splits), generator=gen)
    spec = dict(layer.state_spec().shapes)
    pools = {name: torch.randn(5, *shape, generator=gen) * 0.3 for name, shape in spec.items()}
    recurrent = []
    with monkeypatch.context() as patch:
        tested = layer
        if path == "kernels":
            real = gdn_kernels.gdn_prefill
            patch.setattr(gated_deltanet, "decode_kernels_on", lambda x: True)
            patch.setattr(
                gdn_kernels,
                "gdn_prefill",
                lambda qkv, *a, **k: recurrent.append(qkv.shape[0]) or real(qkv, *a, **k),
            )
            tested = _gdn_layer(13).to(KERNEL_DEVICE)
        out, state, snaps = _gdn_prefill(tested, proj, lengths, slots, pools, checkpoints, snapshots=6)
    assert recurrent == ([3, 4] if path == "kernels" else [])
    starts = [0, 3, 3 + long]
    for i, (start, n) in enumerate(zip(starts, lengths, strict=True)):
        alone_out, alone_state, alone_snaps = _gdn_prefill(
            layer, proj[start : start + n], [n], [slots[i]], pools, [checkpoints[i]], snapshots=6
        )
        torch.testing.assert_close(out[start : start + n], alone_out, atol=1e-4, rtol=1e-4)
        for name in spec:
            torch.testing.assert_close(
                state[name][slots[i]], alone_state[name][slots[i]], atol=1e-5, rtol=1e-5
            )
    for snap, (segment, tokens) in {0: (0, 0), 1: (0, 1), 2: (0, 2), 3: (2, 1), 4: (2, 2)}.items():
        start, slot = starts[segment], slots[segment]
        want = (
            _gdn_prefill(layer, proj[start : start + tokens], [tokens], [slot], pools)[1] if tokens else pools
        )
        torch.testing.assert_close(snaps["ssm"][snap], want["ssm"][slot], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(snaps["conv"][snap], want["conv"][slot], atol=0, rtol=0)
    assert (snaps["ssm"][5] == -7.0).all()
