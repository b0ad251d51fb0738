"""The qwen35 plugin passes the same conformance suite a third-party plugin runs, dense and MoE."""

from __future__ import annotations

from pegainfer.testing.suite import PluginConformance


class TestQwen35Conformance(PluginConformance):
    model_name = "qwen35"
    architecture = "qwen3_5"


class TestQwen35MoeConformance(PluginConformance):
    model_name = "qwen35"
    architecture = "qwen3_5_moe"
