"""Bearer-token auth for ``/v1/*``: a dependency comparing keys in constant time."""

from __future__ import annotations

import hmac

from fastapi import Request

from pegainfer.server.errors import APIError


def _unauthorized(message: str) -> APIError:
    return APIError(
        401,
        message,
        type="invalid_request_error",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


def api_key_dependency(api_key: str | None):
    """A FastAPI dependency that lets a request through only with ``Authorization: Bearer <api_key>``;
    with no key configured it lets everything through."""
    expected = api_key.encode() if api_key else None

    async def check(request: Request) -> None:
        if expected is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise _unauthorized("missing API key: send 'Authorization: Bearer <key>'")
        if not hmac.compare_digest(token.strip().encode(), expected):
            raise _unauthorized("incorrect API key")

    return check
