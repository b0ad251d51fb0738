"""The deepseek plugin passes the same conformance suite a third-party plugin runs."""

from __future__ import annotations

from pegainfer.testing.suite import PluginConformance


class TestDeepseekConformance(PluginConformance):
    model_name = "deepseek"
    architecture = "deepseek_v3"
    async_scheduling = False  # hidden states come from its runner, not the decode graph: no carried tokens
    speculative_num_tokens = 2  # its MTP layer drafts during the tensor-parallel check


class TestDeepseekV32Conformance(PluginConformance):
    model_name = "deepseek"
    architecture = "deepseek_v32"
    async_scheduling = False


class TestDeepseekV4Conformance(PluginConformance):
    model_name = "deepseek_v4"
    architecture = "deepseek_v4"
    tensor_parallel_size = 0  # refused: not sharded
    async_scheduling = False  # hidden states come from its runner: no carried tokens
    prefix_caching = False  # refused: compressed entries are written into full pages later (v4_model.py)
