"""The qwen35 plugin's embedded demo: a tiny random Qwen3.5 (GDN + gated attention layers, the published
VLM layout) with a small tokenizer; its head counts split over 2 tensor-parallel ranks."""

from __future__ import annotations

from pathlib import Path

from pegainfer.plugins.tiny_checkpoints import write_tiny_checkpoint


def write_demo_checkpoint(folder: Path) -> None:
    write_tiny_checkpoint(folder, "qwen3_5", seed=1234, hidden_size=128, intermediate_size=256)
