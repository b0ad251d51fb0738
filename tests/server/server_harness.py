"""Test harness: a real uvicorn server on 127.0.0.1 (a free port), in a thread of the test process, so
tests can both talk HTTP to it and inspect its engine between steps (``ServerHandle.call``)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from pegainfer.config.compose import build_engine_config, compose
from pegainfer.engine.async_engine import AsyncLLMEngine
from pegainfer.engine.llm_engine import LLMEngine
from pegainfer.server.app import bind_socket, make_server
from pegainfer.server.config import ServerConfig

API_KEY = "sk-test-0123456789"
#: Tools whose arguments a random model completes in a few tokens (bounded values, no free strings).
BOUNDED_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"enum": ["Paris", "Rome"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                },
                "required": ["city", "days"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "now", "parameters": {"type": "object", "additionalProperties": False}},
    },
]
MAX_MODEL_LEN = 512


@dataclass
class ServerHandle:
    url: str
    engine: AsyncLLMEngine
    server: Any
    thread: threading.Thread

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {API_KEY}"}

    def client(self, **kwargs: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=30.0, **kwargs)

    def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread between steps."""
        return self.engine.call(fn).result(timeout=30)

    def wait_idle(self, timeout: float = 20.0) -> None:
        """Wait until the engine holds no request at all."""
        deadline = time.monotonic() + timeout
        while self.call(lambda e: e.has_unfinished_requests()):
            assert time.monotonic() < deadline, "the engine still has requests"
            time.sleep(0.02)

    def assert_pool_whole(self) -> None:
        """No request left, every page and slot back in the pool, nothing owned twice."""
        self.wait_idle()

        def check(engine: LLMEngine) -> tuple[float, int, int]:
            engine.buffers.check_invariants()
            return engine.buffers.usage(), engine.scheduler.num_running, engine.scheduler.num_waiting

        assert self.call(check) == (0.0, 0, 0)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), "the server did not stop"


def start_server(
    checkpoint: Path,
    overrides: list[str] = (),  # type: ignore[assignment]
    **server_options: Any,
) -> ServerHandle:
    config = build_engine_config(
        compose(
            "serve",
            [
                f"model.path={checkpoint}",
                "device=cpu",
                "model.dtype=float32",
                f"model.max_model_len={MAX_MODEL_LEN}",
                "cache.cpu_kv_cache_bytes=16777216",
                *overrides,
            ],
        )
    )
    options = {"api_key": API_KEY, "log_interval": 0.0, "log_level": "warning", **server_options}
    server_config = ServerConfig(**options)
    engine = AsyncLLMEngine(
        LLMEngine(config),
        max_waiting_requests=server_config.max_waiting_requests,
        log_interval=server_config.log_interval,
    )
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = make_server(engine, server_config.model_copy(update={"port": port}))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    return ServerHandle(f"http://127.0.0.1:{port}", engine, server, thread)
