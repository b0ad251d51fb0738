"""The embedded demo models: a plugin's tiny random checkpoint, written on first use, so a new user sees
text come out with no download. Their weights are random, so their text is gibberish by design.

``model=NAME`` without ``model.path`` runs that model's own demo (its registration's
``demo_checkpoint`` writer); ``model=auto`` without a path runs ``demo_model``'s (an engine setting).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from pegainfer.plugins.registry import ModelRegistration

#: Bumped when a demo writer changes what it writes, so a cached older demo is not reused.
DEMO_VERSION = 1


def cache_dir() -> Path:
    root = os.environ.get("PEGAINFER_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pegainfer"
    )
    return Path(root)


def demo_checkpoint(registration: ModelRegistration) -> Path:
    """``registration``'s demo checkpoint folder, written the first time."""
    return _written_once(
        f"demo-{registration.name}-v{DEMO_VERSION}", "config.json", registration.load_demo_writer()
    )


def demo_tokenizer() -> Path:
    """A folder with the demo models' byte-level tokenizer (1000 ids), written the first time: what a
    checkpoint without tokenizer files runs with under ``model.load_format=dummy``."""
    from pegainfer.text.tiny_tokenizer import write_tiny_tokenizer

    return _written_once(f"tokenizer-byte-level-v{DEMO_VERSION}", "tokenizer.json", write_tiny_tokenizer)


def _written_once(name: str, marker: str, write: Callable[[Path], object]) -> Path:
    """``cache_dir() / name``, filled by ``write(folder)`` atomically (temp folder + rename) unless it holds
    ``marker`` already."""
    target = cache_dir() / name
    if (target / marker).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=name, dir=target.parent))
    try:
        write(tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / marker).exists():  # another process may have won the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
