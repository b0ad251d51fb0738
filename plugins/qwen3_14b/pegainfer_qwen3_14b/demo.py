"""The qwen3_14b plugin's embedded demo: a tiny random Qwen3 (4 layers, hidden 128) with a small tokenizer."""

from __future__ import annotations

from pathlib import Path

from pegainfer.plugins.tiny_checkpoints import write_tiny_checkpoint


def write_demo_checkpoint(folder: Path) -> None:
    write_tiny_checkpoint(
        folder, "qwen3", seed=1234, hidden_size=128, intermediate_size=384, num_hidden_layers=4
    )
