"""``kernels.l2_prefetch``: asking the L2 for a tensor ahead of its reader is a hint, on the GPU only."""

from __future__ import annotations

import pytest
import torch

from pegainfer.kernels import _triton
from pegainfer.kernels.l2_prefetch import CHUNK, prefetch_l2


def test_off_the_gpu_nothing_asks_for_a_prefetch(monkeypatch):
    """The switch is off for CPU tensors whatever the environment names (the interpreter has no bulk
    prefetch), and off for a family the environment leaves out."""
    monkeypatch.setattr(_triton, "L2_PREFETCH", {"gemm", "pairs", "down", "ahead"})
    w = torch.empty(64, 256, dtype=torch.bfloat16)
    assert not _triton.l2_prefetch_on(w, "ahead", w)
    monkeypatch.setattr(_triton, "_hopper", lambda t: True)
    assert _triton.l2_prefetch_on(w, "ahead", w)
    assert not _triton.l2_prefetch_on(w, "ahead", torch.empty(64, 260, dtype=torch.bfloat16)[:, :252])
    monkeypatch.setattr(_triton, "L2_PREFETCH", {"gemm"})
    assert not _triton.l2_prefetch_on(w, "ahead", w)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_prefetch_runs_eager_and_in_a_graph_and_changes_nothing():
    """A prefetch launch between two kernels of a graph (with PDL on either side) leaves every tensor as
    it was and the next kernel's result unchanged; tensors shorter than a piece launch nothing."""
    w = torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16)
    before = w.clone()
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    expected = x @ w.T
    prefetch_l2(w)
    prefetch_l2(torch.empty(CHUNK // 2 - 1, device="cuda", dtype=torch.bfloat16))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x * 1
        prefetch_l2(w)
        out = y @ w.T
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(w, before)
    assert torch.equal(out, expected)
