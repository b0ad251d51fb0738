"""The FastAPI app (``build_app``) and the uvicorn runner with a graceful SIGTERM drain (``run_server``).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``, ``POST /tokenize``,
``POST /detokenize`` (Bearer auth when an API key is set), and ``GET /health``, ``/metrics``, ``/version``
(no auth, for probes and scrapers).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from pegainfer import __version__
from pegainfer.config.schema import EngineConfig
from pegainfer.engine.async_engine import AsyncLLMEngine
from pegainfer.server.auth import api_key_dependency
from pegainfer.server.config import ServerConfig
from pegainfer.server.errors import APIError, ErrorResponse, error_response, install_error_handlers
from pegainfer.server.metrics import CONTENT_TYPE, MetricsListener
from pegainfer.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeBody,
)
from pegainfer.server.serving_chat import ChatServing
from pegainfer.server.serving_completion import CompletionServing
from pegainfer.server.serving_tokens import TokenServing

logger = logging.getLogger(__name__)

# Seconds past the drain timeout after which uvicorn cancels what is still running.
_BACKSTOP_S = 2.0

# uvicorn's log lines carry the timestamp pegainfer's own carry (pegainfer.cli._setup_logging).
LOG_TIME_PREFIX = "%(asctime)s.%(msecs)03d "
LOG_DATEFMT = "%Y-%m-%dT%H:%M:%S"


def uvicorn_log_config() -> dict[str, Any]:
    """uvicorn's own logging config, each line prefixed with an ISO-like local timestamp."""
    config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    for formatter in config["formatters"].values():
        formatter["fmt"] = LOG_TIME_PREFIX + formatter["fmt"]
        formatter["datefmt"] = LOG_DATEFMT
    return config


def _error(description: str, headers: dict[str, Any] | None = None) -> dict[str, Any]:
    doc: dict[str, Any] = {"model": ErrorResponse, "description": description}
    if headers:
        doc["headers"] = headers
    return doc


_RETRY_AFTER = {
    "Retry-After": {"description": "Seconds to wait (overloaded only)", "schema": {"type": "integer"}}
}
_WWW_AUTHENTICATE = {"WWW-Authenticate": {"description": "Bearer", "schema": {"type": "string"}}}


def _documented_responses(
    auth: bool, *, generates: bool, reads_text: bool = False
) -> dict[int | str, dict[str, Any]]:
    """The answers an operation gives, for the OpenAPI document (every error is an ErrorResponse)."""
    responses: dict[int | str, dict[str, Any]] = {}
    if reads_text:
        responses[400] = _error("Invalid request: a malformed body, a token id outside the vocabulary")
    if generates:
        responses[200] = {
            "description": "The result; with stream true, server-sent events (`data:` chunks, then "
            "`data: [DONE]`)",
            "content": {"text/event-stream": {"schema": {"type": "string"}}},
        }
        responses[400] = _error(
            "Invalid request: a malformed body, a value out of range, a prompt past the context length, "
            "an unsupported field"
        )
    if auth:
        responses[401] = _error("Missing or incorrect API key", _WWW_AUTHENTICATE)
    if generates or reads_text:
        responses[404] = _error("The model named in `model` is not served here (code model_not_found)")
    if generates:
        responses[500] = _error("The request failed inside the engine")
        responses[503] = _error(
            "Overloaded (too many waiting requests), shutting down, or the engine has died", _RETRY_AFTER
        )
    return responses


def _openapi_without_422(app: FastAPI) -> None:
    """FastAPI documents a 422 for every operation with a body; this server answers 400 instead (and
    documents it), so the 422 and its schemas leave the OpenAPI document."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            for operations in schema.get("paths", {}).values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
            schemas = schema.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
        return app.openapi_schema  # type: ignore[return-value]

    app.openapi = openapi  # type: ignore[method-assign]


def model_names(engine: AsyncLLMEngine, config: ServerConfig) -> list[str]:
    """The names a request's ``model`` may use: the served name first, then the path as configured."""
    llm = engine.engine
    names = [config.served_model_name or Path(llm.executor.info.folder).name]
    path = llm.config.model.path
    if path and path not in names:
        names.append(path)
    return names


def build_app(engine: AsyncLLMEngine, config: ServerConfig) -> FastAPI:
    """The app serving ``engine``; its lifespan starts the engine thread and shuts it down."""
    metrics = MetricsListener(engine.snapshot)
    engine.listener = metrics
    names = model_names(engine, config)
    completions = CompletionServing(engine, names)
    chat = ChatServing(engine, names, reasoning=config.reasoning_parser is not None)
    tokens = TokenServing(engine, names)
    max_model_len = engine.engine.max_model_len
    started = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            await engine.shutdown(drain_timeout=0.0)

    app = FastAPI(title="pegainfer", version=__version__, lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics = metrics
    install_error_handlers(app)
    _openapi_without_422(app)
    auth = config.resolved_api_key() is not None

    @app.get(
        "/health",
        responses={
            200: {
                "description": "The engine runs and accepts requests",
                "content": {"application/json": {"example": {"status": "ok"}}},
            },
            503: _error("The engine has died, or the server is draining"),
        },
    )
    async def health() -> Response:
        if engine.dead_error is not None:
            return error_response(APIError(503, str(engine.dead_error), code="engine_dead"))
        if not engine.accepting:
            return error_response(APIError(503, "the server is shutting down", code="shutting_down"))
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get(
        "/metrics",
        response_class=PlainTextResponse,
        responses={200: {"description": "Prometheus text exposition format (version 0.0.4)"}},
    )
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    authorized = [Depends(api_key_dependency(config.resolved_api_key()))]
    v1 = APIRouter(prefix="/v1", dependencies=authorized)
    text = APIRouter(dependencies=authorized)  # vLLM's paths: no /v1

    @v1.get("/models", responses=_documented_responses(auth, generates=False))
    async def models() -> dict[str, object]:
        data = [
            {
                "id": name,
                "object": "model",
                "created": started,
                "owned_by": "pegainfer",
                "max_model_len": max_model_len,
            }
            for name in names[:1]
        ]
        return {"object": "list", "data": data}

    generating = _documented_responses(auth, generates=True)

    @v1.post("/completions", responses=generating)
    async def create_completion(body: CompletionRequest, raw: Request) -> Response:
        return await completions.create(body, raw)

    @v1.post("/chat/completions", responses=generating)
    async def create_chat_completion(body: ChatCompletionRequest, raw: Request) -> Response:
        return await chat.create(body, raw)

    tokenizing = _documented_responses(auth, generates=False, reads_text=True)

    @text.post("/tokenize", responses=tokenizing)
    async def tokenize(body: TokenizeBody) -> dict[str, Any]:
        return tokens.tokenize(body)

    @text.post("/detokenize", responses=tokenizing)
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        return tokens.detokenize(body)

    app.include_router(v1)
    app.include_router(text)
    return app


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, plus: the first SIGTERM/SIGINT makes the engine refuse new requests (``/health``
    turns 503) while uvicorn drains the open ones, and the signal is not re-raised afterwards (exit 0)."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLMEngine, drain_timeout: float) -> None:
        super().__init__(config)
        self._engine = engine
        self._drain_timeout = drain_timeout

    def handle_exit(self, sig: int, frame: object) -> None:
        if not self.should_exit:
            logger.info(
                "signal %d: draining open requests (up to %ss), then exiting", sig, self._drain_timeout
            )
            self._engine.stop_accepting()
            # At the deadline the engine ends what is left with an error event, so each client gets a
            # well-formed response; uvicorn's own timeout, a little later, is only the backstop.
            timer = threading.Timer(self._drain_timeout, self._engine.cut_open_requests)
            timer.daemon = True
            timer.start()
        super().handle_exit(sig, frame)  # type: ignore[arg-type]

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def make_server(engine: AsyncLLMEngine, config: ServerConfig) -> uvicorn.Server:
    """A uvicorn server for ``build_app(engine, config)``; ``run()`` it, or ``serve(sockets=[...])``."""
    uv_config = uvicorn.Config(
        build_app(engine, config),
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        access_log=config.access_log,
        log_config=uvicorn_log_config(),
        timeout_graceful_shutdown=config.drain_timeout + _BACKSTOP_S,  # type: ignore[arg-type]
        lifespan="on",
    )
    return _DrainingServer(uv_config, engine, config.drain_timeout)


def run_server(engine_config: EngineConfig, config: ServerConfig) -> int:
    """``pegainfer serve``: build the engine, serve until SIGTERM/SIGINT, drain, return 0."""
    from pegainfer.engine.llm_engine import LLMEngine  # heavy (torch)

    engine = AsyncLLMEngine(
        LLMEngine(engine_config),
        max_waiting_requests=config.max_waiting_requests,
        log_interval=config.log_interval,
    )
    server = make_server(engine, config)
    names = model_names(engine, config)
    logger.info(
        "serving '%s' on http://%s:%d (OpenAI API under /v1)",
        names[0],
        _display_host(config.host),
        config.port,
    )
    server.run()
    return 0


def _display_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def bind_socket(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A listening-ready socket on ``host:port`` (port 0: a free one), for tests and embedding."""
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say they are TCP, and without it
    # a keep-alive response written in two parts waits out the client's delayed ACK (~40 ms).
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock
