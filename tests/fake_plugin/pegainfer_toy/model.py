"""ToyQwen3: pegainfer's Qwen3 with its logits multiplied by ``model.logit_scale``."""

from __future__ import annotations

from typing import Any

import torch

from pegainfer.config.schema import ModelConfig
from pegainfer_qwen3_14b.model import Qwen3Dims, Qwen3ForCausalLM
from pegainfer_toy.config import ToyQwen3Config


class ToyQwen3ForCausalLM(Qwen3ForCausalLM):
    """A Qwen3 checkpoint relabelled ``ToyQwen3ForCausalLM``; only the logits differ."""

    def __init__(
        self, dims: Qwen3Dims, *, dtype: torch.dtype, max_model_len: int, logit_scale: float
    ) -> None:
        super().__init__(dims, dtype=dtype, max_model_len=max_model_len)
        self.logit_scale = logit_scale

    @classmethod
    def from_hf_config(
        cls, hf_config: dict[str, Any], model_config: ModelConfig, *, dtype: torch.dtype, max_model_len: int
    ) -> ToyQwen3ForCausalLM:
        # The CLI validates model.* with ToyQwen3Config; a caller that built a plain ModelConfig gets defaults.
        if not isinstance(model_config, ToyQwen3Config):
            model_config = ToyQwen3Config.model_validate(model_config.model_dump())
        return cls(
            Qwen3Dims.from_hf_config(hf_config),
            dtype=dtype,
            max_model_len=max_model_len,
            logit_scale=model_config.logit_scale,
        )

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) * self.logit_scale
