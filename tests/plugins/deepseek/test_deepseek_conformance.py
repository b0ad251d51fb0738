"""The deepseek plugin passes the same conformance suite a third-party plugin runs."""

from __future__ import annotations

from pegainfer.testing.suite import PluginConformance


class TestDeepseekConformance(PluginConformance):
    model_name = "deepseek"
    architecture = "deepseek_v3"


class TestDeepseekV4Conformance(PluginConformance):
    model_name = "deepseek_v4"
    architecture = "deepseek_v4"
