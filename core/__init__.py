"""pegainfer: LLM inference and serving on torch and Triton.

``from pegainfer import LLM, SamplingParams`` is the offline API; heavy modules load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "SamplingParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
    "__version__",
]

if TYPE_CHECKING:
    from pegainfer.engine.llm import LLM
    from pegainfer.engine.outputs import CompletionOutput, RequestOutput
    from pegainfer.sampling.sampling_params import SamplingParams
    from pegainfer.sampling.structured import StructuredOutputsParams

_LAZY = {
    "LLM": "pegainfer.engine.llm",
    "SamplingParams": "pegainfer.sampling.sampling_params",
    "StructuredOutputsParams": "pegainfer.sampling.structured",
    "RequestOutput": "pegainfer.engine.outputs",
    "CompletionOutput": "pegainfer.engine.outputs",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pegainfer' has no attribute {name!r}")
