"""Log lines carry a timestamp: pegainfer's own (the CLI's stderr handler) and the server's uvicorn ones."""

from __future__ import annotations

import importlib
import logging
import re

import pytest
from server_harness import ServerHandle

from pegainfer.cli import _setup_logging
from pegainfer.server.app import uvicorn_log_config

# 2026-01-02T03:04:05.678, at the start of the line.
STAMP = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3} ")


def test_pegainfer_log_lines_start_with_a_timestamp(capsys: pytest.CaptureFixture[str]) -> None:
    _setup_logging()
    logging.getLogger("pegainfer.server.app").info("serving 'demo-qwen3_14b-v1' on http://127.0.0.1:8000")
    line = capsys.readouterr().err.splitlines()[-1]
    assert STAMP.match(line), line
    # What tests/server/test_sigterm.py looks for is still there as it was.
    assert line[STAMP.match(line).end() :] == (
        "INFO pegainfer.server.app: serving 'demo-qwen3_14b-v1' on http://127.0.0.1:8000"
    )


@pytest.mark.parametrize("kind", ["default", "access"])
def test_uvicorn_log_lines_start_with_a_timestamp(server: ServerHandle, kind: str) -> None:
    # The server's uvicorn runs with this config (make_server), both of its formatters stamped.
    assert server.server.config.log_config == uvicorn_log_config()
    spec = dict(uvicorn_log_config()["formatters"][kind])
    module, _, cls = spec.pop("()").rpartition(".")
    formatter = getattr(importlib.import_module(module), cls)(**{**spec, "use_colors": False})
    record = logging.LogRecord("uvicorn.error", logging.INFO, __file__, 1, "Started server process", (), None)
    if kind == "access":
        record.name = "uvicorn.access"
        record.msg, record.args = '%s - "%s %s HTTP/%s" %d', ("127.0.0.1:5000", "GET", "/health", "1.1", 200)
    line = formatter.format(record)
    assert STAMP.match(line), line
    assert line.endswith("Started server process" if kind == "default" else '"GET /health HTTP/1.1" 200 OK')
