"""The order of a kernel's PDL wait and release, read from the PTX compiled for Hopper (no GPU needed).

``pdl_start`` waits, then lets the next kernel in, unless ``PEGAINFER_PDL_RELEASE_FIRST=1`` (read at
import, so each case compiles in a process of its own); the MoE pair path's gate|up always waits first,
since its successor reads the expert ids before its own wait."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

PROBE = """
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource
from pegainfer.kernels import _triton as T

@triton.jit
def kernel(x_ptr, PDL: tl.constexpr, ORDERED: tl.constexpr):
    if ORDERED:
        T.pdl_start_ordered(PDL)
    else:
        T.pdl_start(PDL)
    tl.store(x_ptr, tl.load(x_ptr) + 1)

for ordered in (False, True):
    src = ASTSource(kernel, {"x_ptr": "*fp32", "PDL": "constexpr", "ORDERED": "constexpr"},
                    constexprs={"PDL": True, "ORDERED": ordered})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    print(" ".join(l.split()[0].split(".")[1] for l in ptx.splitlines() if "griddepcontrol" in l))
"""


def _orders(release_first: str | None, folder) -> list[str]:
    env = {
        k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PEGAINFER_PDL_RELEASE_FIRST")
    }
    if release_first is not None:
        env["PEGAINFER_PDL_RELEASE_FIRST"] = release_first
    probe = folder / "pdl_probe.py"  # Triton compiles only kernels defined in a file
    probe.write_text(PROBE)
    out = subprocess.run(
        [sys.executable, str(probe)], env=env, capture_output=True, text=True, timeout=240, check=True
    )
    return out.stdout.split("\n")[:2]


@pytest.mark.parametrize(
    ("switch", "plain"),
    [(None, "wait launch_dependents"), ("0", "wait launch_dependents"), ("1", "launch_dependents wait")],
)
def test_release_order_follows_the_switch_and_ordered_always_waits_first(switch, plain, tmp_path):
    assert _orders(switch, tmp_path) == [plain, "wait launch_dependents"]
