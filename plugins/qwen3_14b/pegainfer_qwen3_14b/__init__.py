"""The Qwen3 dense plugin (Qwen3-0.6B ... 32B; Qwen3-14B is the flagship)."""
