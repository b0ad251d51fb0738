"""Typed errors: every message says what was wrong and what to do about it."""

from __future__ import annotations


class PegainferError(Exception):
    """Base class of every error pegainfer raises on purpose."""


class ConfigError(PegainferError, ValueError):
    """A configuration value is missing, unknown or out of range; the message names the key."""


class CheckpointError(PegainferError):
    """A checkpoint folder is incomplete or inconsistent; the message names the tensor or file."""


class PluginError(PegainferError):
    """A plugin failed to load or registered something invalid; the message names the plugin."""


class RequestError(PegainferError, ValueError):
    """A request is invalid (bad sampling values, prompt too long, ...); maps to an HTTP 400."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ExecutorError(PegainferError):
    """The executor was handed a batch it cannot run, or a worker failed."""
