"""The embedded default model: a tiny random Qwen3 checkpoint created on first use, so a new user sees
text come out with no download. Its weights are random, so its text is gibberish by design."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

DEMO_NAME = "demo-qwen3-tiny-v1"


def cache_dir() -> Path:
    root = os.environ.get("PEGAINFER_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pegainfer"
    )
    return Path(root)


def demo_checkpoint() -> Path:
    """The demo checkpoint folder, written atomically (temp folder + rename) the first time."""
    from pegainfer.testing.checkpoints import write_tiny_checkpoint

    target = cache_dir() / DEMO_NAME
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=DEMO_NAME, dir=target.parent))
    try:
        write_tiny_checkpoint(
            tmp, "qwen3", seed=1234, hidden_size=128, intermediate_size=384, num_hidden_layers=4
        )
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").exists():  # another process may have won the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
