"""Errors in OpenAI's format: ``{"error": {"message", "type", "param", "code"}}``, and the handlers that make
every failure one of them (validation 400s instead of FastAPI's 422, 401, 404, 500 without internals)."""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from pegainfer.engine.request_stream import EngineDeadError, EngineOverloadedError, EngineStoppedError
from pegainfer.errors import RequestError

logger = logging.getLogger(__name__)


class APIError(Exception):
    """An error answered to the client as it is: status, OpenAI ``type``, and optional param and code."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _default_type(status)
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


class ErrorInfo(BaseModel):
    message: str = Field(description="What went wrong, for a person to read.")
    type: str = Field(description="e.g. invalid_request_error, authentication_error, server_error.")
    param: str | None = Field(description="The request field the error concerns, if one does.")
    code: str | None = Field(description="A stable code, e.g. model_not_found, invalid_api_key, overloaded.")


class ErrorResponse(BaseModel):
    """OpenAI's error body: every error answer of the server is one (the OpenAPI document names it)."""

    error: ErrorInfo


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _default_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def to_api_error(exc: BaseException) -> APIError:
    """The client-facing form of an exception raised while serving a request."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestError):
        return bad_request(str(exc), exc.param)
    if isinstance(exc, EngineOverloadedError):
        return APIError(503, str(exc), code="overloaded", headers={"Retry-After": str(exc.retry_after)})
    if isinstance(exc, EngineStoppedError):
        return APIError(503, str(exc), code="shutting_down")
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), code="engine_dead")
    # Anything else is our bug: log it in full, tell the client nothing about the internals.
    logger.error("internal error while serving a request", exc_info=exc)
    return APIError(500, "internal server error; the request failed", code="internal_error")


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One readable line for the first validation error, and the parameter it concerns."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    err = errors[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body" and not _is_type_tag(str(p))]
    if err.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    if not loc and err.get("type") in ("missing", "model_attributes_type", "dict_type"):
        return "the request body must be a JSON object", None
    param = loc[0] if loc else None
    # Union members add their type name or tag to the location (prompt.str): left out above, so the path
    # is the user's field path.
    path = ".".join(loc)
    msg = str(err.get("msg", "invalid value"))
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return f"invalid value for '{path or param}': {msg}{more}", param


def _is_type_tag(part: str) -> bool:
    return part in ("str", "int", "float", "bool") or part.startswith(
        ("list[", "dict[", "function-", "tagged:")
    )


def _respond(request: Request, error: APIError) -> JSONResponse:
    metrics = getattr(request.app.state, "metrics", None)
    if metrics is not None:
        metrics.error_sent(error.status)
    return error_response(error)


def install_error_handlers(app: FastAPI) -> None:
    """Route every failure through the OpenAI error format (and count it in /metrics)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return _respond(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return _respond(request, bad_request(message, param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        try:
            phrase = HTTPStatus(exc.status_code).phrase
        except ValueError:
            phrase = "error"
        message = exc.detail if isinstance(exc.detail, str) else phrase
        if exc.status_code == 404:
            message = f"{request.method} {request.url.path} not found"
        return _respond(request, APIError(exc.status_code, message, headers=getattr(exc, "headers", None)))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        return _respond(request, to_api_error(exc))
