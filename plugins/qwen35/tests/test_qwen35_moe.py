"""The sparse MoE block against transformers' block, in both reference schedules (grouped by expert for
prefill steps; static shapes without host syncs for decode steps, which run inside CUDA graphs) and
through the expert kernels; the shared expert (24 features) runs as two 16-feature experts."""

from __future__ import annotations

import copy

import pytest
import torch

from pegainfer import ops
from pegainfer.testing.triton_kernels import KERNEL_DEVICE, requires_kernels
from pegainfer_qwen35 import routing
from pegainfer_qwen35.config import Qwen35Config
from pegainfer_qwen35.moe import SparseMoE
from pegainfer_qwen35.pass_buffers import PassBuffers, pass_buffer_roles

H, E, K, IE, IS = 32, 8, 3, 16, 24


def _config() -> Qwen35Config:
    return Qwen35Config(
        vocab_size=64, hidden_size=H, num_layers=1, layer_types=("linear_attention",), rms_norm_eps=1e-6,
        tie_word_embeddings=False, max_position_embeddings=64, num_heads=2, num_kv_heads=1, head_dim=8,
        rotary_dim=2, rope_theta=1e4, linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=8, conv_kernel=4, num_experts=E, num_experts_per_tok=K, moe_intermediate_size=IE,
        shared_expert_intermediate_size=IS,
    )  # fmt: skip


def _random_blocks(config: Qwen35Config, seed: int):
    """Our block with random weights, the shared expert as pieces after the routed experts (zero-padded to
    whole pieces), and transformers' block holding the same weights."""
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

    h, e, i_s = config.hidden_size, config.num_experts, config.shared_expert_intermediate_size
    gen = torch.Generator().manual_seed(seed)
    ours = SparseMoE(config, torch.float32)
    for p in ours.parameters():
        p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    shared = [torch.randn(i_s, h, generator=gen) * h**-0.5 for _ in range(2)]
    shared.append(torch.randn(h, i_s, generator=gen) * i_s**-0.5)
    ours._load_shared(*shared)
    hf_config = Qwen3_5MoeTextConfig(
        hidden_size=h, num_experts=e, num_experts_per_tok=config.num_experts_per_tok,
        moe_intermediate_size=config.moe_intermediate_size, shared_expert_intermediate_size=i_s,
    )  # fmt: skip
    ref = Qwen3_5MoeSparseMoeBlock(hf_config).eval()
    with torch.no_grad():
        ref.gate.weight.copy_(ours.router[:e])
        ref.experts.gate_up_proj.copy_(ours.experts_gate_up[:e])
        ref.experts.down_proj.copy_(ours.experts_down[:e])
        ref.shared_expert.gate_proj.weight.copy_(shared[0])
        ref.shared_expert.up_proj.weight.copy_(shared[1])
        ref.shared_expert.down_proj.weight.copy_(shared[2])
        ref.shared_expert_gate.weight.copy_(ours.router[e:])
    return ours, ref


@pytest.fixture(scope="module")
def blocks():
    """The shared expert's 24 features as two 16-feature pieces."""
    return _random_blocks(_config(), 0)


@pytest.mark.parametrize("static_shapes", [False, True], ids=["grouped", "static"])
def test_moe_block_matches_transformers(blocks, static_shapes):
    ours, ref = blocks
    x = torch.randn(13, H, generator=torch.Generator().manual_seed(1))
    bufs = PassBuffers(pass_buffer_roles(_config(), torch.float32), 13, torch.device("cpu"))
    with torch.no_grad():
        out = ours(x, bufs, static_shapes=static_shapes)
        expected = ref(x[None])[0]
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)


@requires_kernels
@pytest.mark.parametrize("tokens", [1, 13], ids=["pairs", "grouped"])
def test_moe_block_through_the_expert_kernels_matches_transformers(blocks, tokens, monkeypatch):
    """The CUDA path (selection kernel, then the routed experts and the shared expert's two pieces in one
    ``ops.fused_moe``) on the kernels' device: a decode step's token (one program per pair) and a prefill's
    (grouped GEMMs)."""
    ours, ref = blocks
    if KERNEL_DEVICE == "cpu":  # the interpreter on CPU tensors: take the CUDA branches anyway
        monkeypatch.setattr(ops, "use_triton", lambda t: True)
        monkeypatch.setattr(routing, "use_triton", lambda t: True)
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(2))
    bufs = PassBuffers(pass_buffer_roles(_config(), torch.float32), tokens, torch.device(KERNEL_DEVICE))
    residual = torch.randn(tokens, H, generator=torch.Generator().manual_seed(3))
    moe = copy.deepcopy(ours).to(KERNEL_DEVICE)
    with torch.no_grad():
        out = moe(x.to(KERNEL_DEVICE), bufs, residual=residual.clone().to(KERNEL_DEVICE))
        expected = residual + ref(x[None])[0]
    torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-5)


@requires_kernels
@pytest.mark.parametrize("in_router", [False, True], ids=["norm-launch", "norm-in-router"])
def test_block_norms_its_rows_as_transformers_block_sees_them(in_router, monkeypatch):
    """With ``norm`` the block takes the rows before its zero-centred RMSNorm: a decode row on the kernels
    (hidden one preload slice wide) has the router's GEMV apply it and write the normed row for the
    experts (``MOE_NORM_IN_ROUTER``), else the norm runs first. Both equal transformers' block on the
    normed row, and the normed row is in ``bufs.normed``."""
    import dataclasses

    from pegainfer.kernels import skinny_gemm
    from pegainfer_qwen35 import moe as moe_module

    h, e, k, ie = 2048, 4, 2, 16
    config = dataclasses.replace(
        _config(), hidden_size=h, num_experts=e, num_experts_per_tok=k, moe_intermediate_size=ie,
        shared_expert_intermediate_size=ie,
    )  # fmt: skip
    ours, ref = _random_blocks(config, 4)
    gen = torch.Generator().manual_seed(5)
    norm_weight = 0.1 * torch.randn(h, generator=gen)

    x = 2 * torch.randn(1, h, generator=gen) + 0.5
    residual = torch.randn(1, h, generator=gen)
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + norm_weight)
    with torch.no_grad():
        expected = residual + ref(normed[None])[0]
    if KERNEL_DEVICE == "cpu":  # the interpreter on CPU tensors: take the CUDA branches anyway
        monkeypatch.setattr(ops, "use_triton", lambda t: True)
        monkeypatch.setattr(routing, "use_triton", lambda t: True)
        monkeypatch.setattr(skinny_gemm, "takes_preload", lambda x, w: x.numel() == x.shape[-1])
    monkeypatch.setattr(moe_module, "MOE_NORM_IN_ROUTER", in_router)
    dtype, dev = torch.bfloat16, torch.device(KERNEL_DEVICE)
    block = ours.to(dev, dtype)
    x, residual, weight = x.to(dev, dtype), residual.to(dev, dtype), norm_weight.to(dev, dtype)
    bufs = PassBuffers(pass_buffer_roles(config, dtype), 1, dev)
    bufs.normed.fill_(7.0)
    assert moe_module._norm_in_router(x, block.router) == in_router
    assert not moe_module._norm_in_router(x.repeat(2, 1), block.router)  # one row only
    with torch.no_grad():
        out = block(x, bufs, residual=residual, norm=weight)
    torch.testing.assert_close(out.float().cpu(), expected, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(bufs.normed[:1].float().cpu(), normed.to(dtype).float(), atol=2e-2, rtol=8e-3)
