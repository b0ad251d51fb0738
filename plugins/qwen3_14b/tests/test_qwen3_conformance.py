"""The qwen3_14b plugin passes the same conformance suite a third-party plugin runs."""

from __future__ import annotations

from pegainfer.testing.suite import PluginConformance


class TestQwen3Conformance(PluginConformance):
    model_name = "qwen3_14b"
    architecture = "qwen3"
