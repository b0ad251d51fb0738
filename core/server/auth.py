"""Bearer-token auth for ``/v1/*``: a dependency comparing keys in constant time."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from pegainfer.server.errors import APIError

# Only for the OpenAPI document (a bearer security scheme on /v1/*): the check below reads the header
# itself, so every failure is one 401 in OpenAI's format.
_bearer = HTTPBearer(auto_error=False, description="The server's API key (server.api_key)")


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
    with no key configured it lets everything through (and the OpenAPI document names no security)."""
    if not api_key:

        async def open_access() -> None:
            return None

        return open_access

    expected = api_key.encode()

    async def check(
        request: Request, _credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
    ) -> None:
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise _unauthorized("missing API key: send 'Authorization: Bearer <key>'")
        if not hmac.compare_digest(token.strip().encode(), expected):
            raise _unauthorized("incorrect API key")

    return check
