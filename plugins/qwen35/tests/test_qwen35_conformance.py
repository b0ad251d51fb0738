"""The qwen35 plugin passes the same conformance suite a third-party plugin runs: Qwen3.5 dense and MoE,
and Qwen3-Next (fused GDN projections, dense and sparse layers, tensor parallel over two ranks)."""

from __future__ import annotations

from pegainfer.testing.suite import PluginConformance


class TestQwen35Conformance(PluginConformance):
    model_name = "qwen35"
    architecture = "qwen3_5"


class TestQwen35MoeConformance(PluginConformance):
    model_name = "qwen35"
    architecture = "qwen3_5_moe"


class TestQwen3NextConformance(PluginConformance):
    model_name = "qwen35"
    architecture = "qwen3_next"
