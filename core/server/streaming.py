"""Server-sent events, client-disconnect handling, and holding back a streamed marker's first part.

A streaming response ends its request when the client goes: Starlette cancels the body iterator, and the
iterator's ``finally`` aborts the engine request. A non-streaming request is watched the same way by
``collect_until_disconnect``, so a client that hangs up never leaves work running on the engine.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from pegainfer.engine.outputs import RequestOutput
from pegainfer.engine.request_stream import RequestStream

DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready."""


def dumps(data: Any) -> str:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def sse(data: Any) -> str:
    """One SSE event carrying ``data`` as JSON."""
    return f"data: {dumps(data)}\n\n"


def sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)


async def wait_for_disconnect(request: Request) -> None:
    """Return once the client has gone (the body must already have been read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def collect_until_disconnect(stream: RequestStream, request: Request) -> dict[int, RequestOutput]:
    """The last output of each prompt of ``stream``; aborts the stream and raises ClientDisconnected if the
    client goes first. Engine errors raised by the stream propagate."""

    async def collect() -> dict[int, RequestOutput]:
        finals: dict[int, RequestOutput] = {}
        async for index, output in stream:
            finals[index] = output
        return finals

    work = asyncio.ensure_future(collect())
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            return work.result()
        raise ClientDisconnected
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
        stream.abort()


def partial_marker(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of ``text`` that begins one of ``markers`` (and is not all of it):
    what a streamed answer holds back until the next piece says whether a marker (a tool-call or think
    tag) starts there."""
    for n in range(min(max(map(len, markers)) - 1, len(text)), 0, -1):
        if any(marker.startswith(text[-n:]) for marker in markers):
            return n
    return 0
