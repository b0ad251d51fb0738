"""``init_dummy_weights``: the random weights of ``model.load_format=dummy`` (benchmarks, tests)."""

import torch
from torch import nn

from pegainfer.model import model_loader


def test_float8_weights_are_drawn_a_slab_at_a_time(monkeypatch):
    """A float8 weight larger than a slab is drawn in slabs of rows (float32 scratch of one slab, not of
    the whole weight), and every slab gets its own values: none is left at its initial content, none
    repeats the first, and the spread is the matrices' N(0, 1/fan_in)."""
    monkeypatch.setattr(model_loader, "_DUMMY_SLAB_ELEMENTS", 3 * 256)
    model = nn.Module()
    model.w = nn.Parameter(torch.zeros(4, 60, 256, dtype=torch.float8_e4m3fn), requires_grad=False)
    model.norm = nn.Parameter(torch.zeros(256), requires_grad=False)
    scratch, empty_like = [], torch.empty_like

    def recording_empty_like(t, **kwargs):
        scratch.append(t.numel())
        return empty_like(t, **kwargs)

    monkeypatch.setattr(torch, "empty_like", recording_empty_like)
    model_loader.init_dummy_weights(model, seed=3)
    assert scratch and max(scratch) <= 3 * 256
    rows = model.w.float().view(-1, 256)
    assert bool((rows.std(dim=1) > 0).all())
    slabs = rows.split(3)
    assert not any(torch.equal(slabs[0], s) for s in slabs[1:])
    assert abs(rows.std().item() / 256**-0.5 - 1) < 0.1
    assert abs(model.norm.mean().item() - 1) < 0.05


def test_small_float8_weights_draw_as_before(monkeypatch):
    """A weight within one slab is one draw: the values a float32 draw of the same generator gives."""
    model = nn.Module()
    model.w = nn.Parameter(torch.zeros(8, 128, dtype=torch.float8_e4m3fn), requires_grad=False)
    model_loader.init_dummy_weights(model, seed=5)
    gen = torch.Generator().manual_seed(5)
    expected = torch.empty(8, 128).normal_(0.0, 128**-0.5, generator=gen).to(torch.float8_e4m3fn)
    assert torch.equal(model.w.view(torch.uint8), expected.view(torch.uint8))
