"""Tiny random checkpoints for plugin tests: ``write_tiny_checkpoint(folder, architecture, ...)`` (see
``pegainfer.plugins.tiny_checkpoints``; an architecture is one a plugin registered with
``register_tiny_checkpoints``)."""

from __future__ import annotations

from pegainfer.plugins.tiny_checkpoints import to_legacy_layout, to_new_layout, write_tiny_checkpoint

__all__ = ["to_legacy_layout", "to_new_layout", "write_tiny_checkpoint"]
