"""The DeepSeek plugin: DeepSeek-V3 / R1 and V3.2 (MLA attention, group-routed MoE)."""
