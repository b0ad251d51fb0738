"""ServerConfig: the ``server`` section of ``pegainfer serve``'s configuration."""

from __future__ import annotations

import os

from pydantic import Field

from pegainfer.config.schema import _Section
from pegainfer.server.reasoning import ParserName

API_KEY_ENV = "PEGAINFER_API_KEY"


class ServerConfig(_Section):
    """How the HTTP server listens and protects itself. ``api_key: null`` falls back to $PEGAINFER_API_KEY."""

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    api_key: str | None = None
    # The name clients put in `model`; null: the checkpoint folder's name.
    served_model_name: str | None = None
    # Requests past this many waiting ones are answered 503 with Retry-After (null: no bound).
    max_waiting_requests: int | None = Field(default=512, ge=1)
    # Seconds in-flight requests get to finish after SIGTERM before they are cut.
    drain_timeout: float = Field(default=30.0, ge=0.0)
    # Seconds between engine status lines in the log (0: none).
    log_interval: float = Field(default=10.0, ge=0.0)
    access_log: bool = False
    log_level: str = Field(default="info", pattern="^(critical|error|warning|info|debug|trace)$")
    # Chat answers' <think> blocks returned apart as `reasoning_content` (server/reasoning.py): "think", or
    # vLLM's names for the same tags ("qwen3", "deepseek_r1", "deepseek_v3"); null: the answer as written.
    reasoning_parser: ParserName | None = None

    def resolved_api_key(self) -> str | None:
        """The key clients must send: the config's, else the environment's; None (or empty): no auth."""
        return self.api_key or os.environ.get(API_KEY_ENV) or None
