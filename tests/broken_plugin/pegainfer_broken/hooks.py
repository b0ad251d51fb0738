"""Fails on import, as a plugin with a missing dependency would."""

from __future__ import annotations

raise ImportError("pegainfer_broken needs the package 'not-installed-anywhere', which is missing")
