"""The Qwen3.5 plugin: the hybrid Gated-DeltaNet + attention family, dense and MoE."""
