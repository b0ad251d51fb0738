"""Where a plugin's Triton kernel tests can run: compiled on a GPU, or through Triton's interpreter on CPU
tensors when ``TRITON_INTERPRET=1`` was set before Triton was first imported (a plugin's conftest sets it).

    pytestmark = requires_kernels   # then build the inputs on KERNEL_DEVICE
"""

from __future__ import annotations

import os

import pytest
import torch

KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def kernels_runnable() -> bool:
    """A GPU, or the interpreter really in place (the environment variable alone is not enough: it only
    counts if set before Triton's first import)."""
    if KERNEL_DEVICE == "cuda":
        return True
    try:
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return False
    return os.environ.get("TRITON_INTERPRET") == "1" and isinstance(tl.standard.sum, InterpretedFunction)


requires_kernels = pytest.mark.skipif(
    not kernels_runnable(), reason="needs a GPU or Triton's interpreter (TRITON_INTERPRET=1 before Triton)"
)
