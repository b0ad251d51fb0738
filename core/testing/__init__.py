"""Helpers for tests: tiny checkpoints and tokenizers that need no downloads."""
