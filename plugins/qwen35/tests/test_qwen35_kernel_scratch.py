"""The CUDA kernel path's memory bound (``pass_buffers.kernel_scratch_parts``) against what its parts
allocate, measured on the CPU by ``kernel_scratch_probe.py`` in a process of its own: fla's chunked delta
rule (its real Python code, so an fla version that allocates more fails here), the torch conv of a long
segment and the fused MoE, each with its Triton launches stubbed out (the kernels allocate nothing of
their own). The peak of the storages each part creates must stay within its bound for that many tokens
and segments."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pegainfer_qwen35 import pass_buffers

sys.path.insert(0, str(Path(__file__).parent))
import kernel_scratch_probe as probe  # noqa: E402

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def peaks() -> dict[str, list[int | None]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, probe.__file__], env=env, capture_output=True, text=True, timeout=300, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(("part", "segments"), [("gdn_fla", 2), ("gdn_conv", 1), ("moe", 1)])
def test_part_allocates_within_its_bound(peaks, part, segments):
    short, long = peaks[part]
    if short is None:
        pytest.skip("fla-core is not installed")
    per_token, per_segment = pass_buffers.kernel_scratch_parts(probe.config(), torch.bfloat16)[part]
    for n, peak in ((probe.TOKENS, short), (probe.LONG_TOKENS, long)):
        bound = per_token * n + per_segment * segments
        print(f"{part} at {n} tokens: allocated {peak} B, bound {bound} B")
        assert 0 < peak <= bound
    # What each further token costs: a per-token term set too low would pass above at a few hundred
    # tokens on the per-segment terms' slack, then overrun at a long prompt.
    growth = (long - short) / (probe.LONG_TOKENS - probe.TOKENS)
    print(f"{part}: {growth:.2f} B a token, bound {per_token}")
    assert growth <= per_token
