"""What a client of AsyncLLMEngine holds: the prompts it submits, the stream their outputs come back on,
and the errors that end a stream early.

Outputs are produced on the engine thread and handed to each stream's ``asyncio.Queue`` on the stream's
own event loop through :func:`deliver`, one wake-up per loop per step.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pegainfer.engine.outputs import RequestOutput
from pegainfer.errors import PegainferError
from pegainfer.sampling.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pegainfer.engine.async_engine import AsyncLLMEngine


class EngineDeadError(PegainferError):
    """The engine loop stopped after an exception; every open request failed and new ones are refused."""


class EngineOverloadedError(PegainferError):
    """The waiting queue is full; the client should retry after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineStoppedError(PegainferError):
    """The engine is shutting down: it takes no new requests, and ones still open at the end are cut."""


@dataclass(frozen=True)
class PromptInput:
    """One prompt of a submission: token ids (required) and the text they came from, if any."""

    prompt_token_ids: list[int]
    prompt: str | None = None
    #: Prefix-caching salt: requests with different salts share no cached pages (vLLM's ``cache_salt``).
    cache_salt: str | None = None


class RequestStream:
    """The outputs of one submission (one or more prompts), in order per prompt.

    ``async for index, output in stream`` yields ``(prompt index, RequestOutput)`` until every prompt has
    finished; it raises ``EngineDeadError`` / ``EngineStoppedError`` if the engine fails or stops first.
    ``abort()`` ends every unfinished prompt; the pages are back before the engine's next step.
    """

    def __init__(self, owner: AsyncLLMEngine, request_ids: list[str], params: SamplingParams) -> None:
        self._owner = owner
        self.request_ids = request_ids
        self.params = params
        self._queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException] = asyncio.Queue()
        self._open = set(range(len(request_ids)))
        self.loop = asyncio.get_running_loop()
        # Engine-thread accounting: output tokens per prompt (DELTA outputs only carry what is new).
        self.num_output_tokens = [0] * len(request_ids)

    @property
    def finished(self) -> bool:
        return not self._open

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        if not self._open:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._open.clear()
            raise item
        index, output = item
        if output.finished:
            self._open.discard(index)
        return item

    def abort(self) -> None:
        """Abort the prompts not finished yet (idempotent, any thread)."""
        for index in sorted(self._open):
            self._owner.abort(self.request_ids[index])
        self._open.clear()

    def _put(self, item: tuple[int, RequestOutput] | BaseException) -> None:
        self._queue.put_nowait(item)


def deliver(items: list[tuple[RequestStream, Any]]) -> None:
    """Hand each item to its stream on the stream's event loop: one wake-up per loop, not per item."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, Any]]] = {}
    for stream, item in items:
        by_loop.setdefault(stream.loop, []).append((stream, item))
    for loop, batch in by_loop.items():

        def put_all(batch: list[tuple[RequestStream, Any]] = batch) -> None:
            for stream, item in batch:
                stream._put(item)

        try:
            loop.call_soon_threadsafe(put_all)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass
