"""The toy model's ``model.*`` schema: pegainfer's ModelConfig plus one key."""

from __future__ import annotations

from pydantic import Field

from pegainfer.config.schema import ModelConfig


class ToyQwen3Config(ModelConfig):
    """``logit_scale`` multiplies the logits before sampling, like an inverse temperature baked into the model."""

    logit_scale: float = Field(default=1.0, gt=0.0)
