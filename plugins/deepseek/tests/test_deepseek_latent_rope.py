"""MLA's one-launch prologue (``latent_rope``) against the torch form on fresh random inputs: the queries'
rope channels rotated in place, the latent normed and its rope key rotated, the rows written at their
slots through shuffled pages (a negative slot skipped), interleaved and half-split pairs, fp32 and bf16.

Without a GPU the kernel runs through Triton's interpreter on CPU tensors (the conftest selects it).
"""

from __future__ import annotations

import os

import pytest
import torch

from pegainfer.layers.attention import write_rows
from pegainfer.layers.norm import rms_norm
from pegainfer.layers.rotary_yarn import PairedRotaryEmbedding, default_inv_freq
from pegainfer_deepseek.latent_rope import latent_rope_

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs a GPU or Triton's interpreter (TRITON_INTERPRET=1 before Triton)",
)


@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "half-split"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_prologue_equals_the_torch_form(interleaved, dtype):
    gen = torch.Generator().manual_seed(3 + interleaved)
    tokens, heads, dn, dr, rkv, page, blocks = (
        5,
        40,
        24,
        16,
        48,
        4,
        9,
    )  # heads span three head blocks, the last partial

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(DEVICE, dtype)

    rotary = PairedRotaryEmbedding(
        default_inv_freq(dr, 10000.0), 64, cos_sin_factor=1.3, interleaved=interleaved
    )
    rotary = rotary.to(DEVICE)
    q, latent, weight = rand(tokens, heads, dn + dr), rand(tokens, rkv + dr), rand(rkv)
    positions = torch.tensor([0, 7, 63, 12, 30], device=DEVICE)
    slots = torch.tensor([5, 30, 1, -1, 17], device=DEVICE)  # token 3 has no slot: nothing written
    cache = rand(blocks, page, rkv + dr)
    want_cache, want_q = cache.clone(), q.clone()
    q_pe, k_pe = rotary(positions, want_q[..., dn:], latent[:, None, rkv:])
    want_q[..., dn:] = q_pe
    rows = torch.cat([rms_norm(latent[:, :rkv], weight, 1e-6), k_pe[:, 0]], dim=-1)
    kept = slots >= 0
    write_rows(want_cache, rows[kept], slots[kept])
    before = latent.clone()

    latent_rope_(q, latent, positions, slots, cache, weight, 1e-6, rotary.cos, rotary.sin, interleaved)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(q.float(), want_q.float(), **tol)
    torch.testing.assert_close(cache.float(), want_cache.float(), **tol)
    assert torch.equal(latent, before)


def test_prologue_refuses_a_cache_of_another_width():
    q, latent = torch.zeros(1, 2, 24, device=DEVICE), torch.zeros(1, 24, device=DEVICE)
    cos = torch.ones(8, 4, device=DEVICE)
    with pytest.raises(ValueError, match="do not fit"):
        latent_rope_(
            q,
            latent,
            torch.zeros(1, dtype=torch.long, device=DEVICE),
            torch.zeros(1, dtype=torch.long, device=DEVICE),
            torch.zeros(2, 4, 20, device=DEVICE),
            torch.ones(16, device=DEVICE),
            1e-6,
            cos,
            cos,
            True,
        )
