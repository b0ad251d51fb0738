"""Fixtures of the server tests: one shared server on the tiny Qwen3 model (see server_harness)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_harness import ServerHandle, start_server


@pytest.fixture(scope="session")
def server(tiny_qwen3: Path) -> Iterator[ServerHandle]:
    """The shared server on the tiny Qwen3 model, with an API key."""
    handle = start_server(tiny_qwen3)
    yield handle
    handle.stop()


@pytest.fixture()
def http(server: ServerHandle) -> Iterator[httpx.Client]:
    with server.client() as client:
        yield client
