"""Kernel tests: each Triton kernel against its torch reference on fresh random inputs.

Without a CUDA GPU the kernels run on CPU tensors through the Triton interpreter. ``triton.jit`` picks
the interpreter when a function is decorated (Triton's own ``tl.sum``, ``tl.cdiv``... included), so
``TRITON_INTERPRET`` is set here, at import, before this directory's modules import Triton; tests/kernels
is collected first, before any other test module could import it. Were Triton imported earlier all the
same (a startup plugin, say), the interpreter cannot work and the CPU kernel tests are skipped with
that reason; ``TRITON_INTERPRET=1 python -m pytest tests/kernels`` still runs them. The rest of the suite
is unaffected: off CUDA no other code launches Triton kernels (every wrapper takes its torch reference).
With a GPU the variable is left alone, and the same small cases run compiled on the GPU beside the
``gpu``-marked ones at realistic sizes.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

_HERE = Path(__file__).parent
_SKIP_REASON = ""

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        _SKIP_REASON = "Triton is not installed (the kernels need Linux); the torch references still run"
    else:
        if not isinstance(tl.standard.sum, InterpretedFunction):
            _SKIP_REASON = (
                "Triton was imported before tests/kernels/conftest.py could set TRITON_INTERPRET=1; "
                "run `TRITON_INTERPRET=1 python -m pytest tests/kernels`"
            )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not _SKIP_REASON:
        return
    for item in items:
        if _HERE in item.path.parents and "gpu" not in item.keywords:
            item.add_marker(pytest.mark.skip(reason=_SKIP_REASON))
