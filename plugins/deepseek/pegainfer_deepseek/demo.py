"""The deepseek plugin's embedded demos: tiny random DeepSeek-V3 (MLA + group-routed MoE + an MTP layer)
and DeepSeek-V4 checkpoints with a small tokenizer."""

from __future__ import annotations

from pathlib import Path

from pegainfer.plugins.tiny_checkpoints import write_tiny_checkpoint


def write_v3_demo_checkpoint(folder: Path) -> None:
    write_tiny_checkpoint(folder, "deepseek_v3", seed=1234)


def write_v4_demo_checkpoint(folder: Path) -> None:
    write_tiny_checkpoint(folder, "deepseek_v4", seed=1234)
