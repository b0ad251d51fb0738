"""AsyncLLMEngine: an asyncio front for LLMEngine, for the HTTP server.

One background thread owns the engine: it applies queued commands (add, abort, call) between steps and
runs ``step()`` while there is work, sleeping on a condition when idle. Outputs go back to each request's
``asyncio.Queue`` through ``loop.call_soon_threadsafe``, once per step for all requests of a loop.

Failure rules: a request whose processing raises is finished by the engine with ``finish_reason="error"``
and the others go on; an exception from ``step()`` itself kills the engine: every open request fails with
``EngineDeadError`` at once, and new requests are refused with it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol, TypeVar

from pegainfer.engine.llm_engine import LLMEngine
from pegainfer.engine.outputs import RequestOutput
from pegainfer.engine.request_stream import (
    EngineDeadError,
    EngineOverloadedError,
    EngineStoppedError,
    PromptInput,
    RequestStream,
    deliver,
)
from pegainfer.errors import RequestError
from pegainfer.sampling.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class FinishedRequest:
    """What the stats listener hears when an engine request ends (on the engine thread)."""

    request_id: str
    num_prompt_tokens: int
    num_output_tokens: int  # over all n sequences
    n: int
    finish_reasons: tuple[str | None, ...]
    arrival_time: float
    first_token_time: float | None
    finished_time: float


class StatsListener(Protocol):
    def request_finished(self, info: FinishedRequest) -> None: ...


@dataclass(frozen=True)
class EngineSnapshot:
    """Engine state as of the last step; safe to read from any thread."""

    alive: bool = True
    accepting: bool = True
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0
    open_requests: int = 0
    #: Prefix caching: prompt tokens of admitted requests, and how many of them were found cached.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


@dataclass
class _Add:
    stream: RequestStream
    inputs: list[PromptInput]
    done: concurrent.futures.Future[None]


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Cut:
    reason: str


@dataclass
class _Call:
    fn: Callable[[LLMEngine], Any]
    done: concurrent.futures.Future[Any]


class AsyncLLMEngine:
    """Serves one LLMEngine to many asyncio tasks. Call ``start()`` once, ``shutdown()`` at the end."""

    def __init__(
        self,
        engine: LLMEngine,
        *,
        max_waiting_requests: int | None = None,
        log_interval: float = 10.0,
        listener: StatsListener | None = None,
    ) -> None:
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.log_interval = log_interval
        self.listener = listener
        self._cond = threading.Condition()
        self._commands: list[_Add | _Abort | _Call | _Cut] = []
        self._streams: dict[str, tuple[RequestStream, int]] = {}  # engine thread only
        self._stopping = False
        self._accepting = True
        self._dead: EngineDeadError | None = None
        self._thread: threading.Thread | None = None
        self._snapshot = EngineSnapshot()
        self._last_log = (time.monotonic(), 0, 0, 0, 0)

    # ------------------------------------------------------------------------------------------ control

    def start(self) -> None:
        """Start the engine thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pegainfer-engine", daemon=True)
            self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._dead is None and self._thread is not None and self._thread.is_alive()

    @property
    def accepting(self) -> bool:
        return self._accepting and self._dead is None

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._dead

    def snapshot(self) -> EngineSnapshot:
        return self._snapshot

    def stop_accepting(self) -> None:
        """Refuse new requests from now on (draining); open ones go on. Any thread."""
        self._accepting = False
        self._snapshot = replace(self._snapshot, accepting=False)

    async def shutdown(self, drain_timeout: float = 0.0) -> None:
        """Stop accepting, wait up to ``drain_timeout`` s for open requests, cut the rest, stop the thread."""
        self.stop_accepting()
        deadline = time.monotonic() + drain_timeout
        while self._snapshot.open_requests and time.monotonic() < deadline and self.is_alive:
            await asyncio.sleep(0.05)
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        self.engine.shutdown()

    # ----------------------------------------------------------------------------------------- requests

    async def submit(
        self, request_id: str, inputs: list[PromptInput], params: SamplingParams
    ) -> RequestStream:
        """Validate and queue one or more prompts under ``params``; all are admitted or none.

        Raises RequestError (bad input), EngineOverloadedError (waiting queue full), EngineDeadError or
        EngineStoppedError. With several prompts the engine ids are ``f"{request_id}-{i}"``.
        """
        self._check_accepting()
        ids = [request_id] if len(inputs) == 1 else [f"{request_id}-{i}" for i in range(len(inputs))]
        stream = RequestStream(self, ids, params)
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._command(_Add(stream, inputs, done))
        try:
            await asyncio.wrap_future(done)
        except asyncio.CancelledError:
            # The caller left while the engine was admitting: whatever got in must not run on unheard.
            stream.abort()
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Abort one engine request (any thread); a no-op when it already finished."""
        self._command(_Abort(request_id))

    def call(self, fn: Callable[[LLMEngine], T]) -> concurrent.futures.Future[T]:
        """Run ``fn(engine)`` on the engine thread between steps (inspection in tests and tools)."""
        done: concurrent.futures.Future[T] = concurrent.futures.Future()
        if self._dead is not None or self._thread is None or not self._thread.is_alive():
            # Nothing runs the engine any more, so it may be read from here.
            try:
                done.set_result(fn(self.engine))
            except Exception as exc:
                done.set_exception(exc)
            return done
        self._command(_Call(fn, done))
        return done

    def _check_accepting(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))
        if not self._accepting:
            raise EngineStoppedError("the server is shutting down and takes no new requests")
        if self._thread is None:
            raise EngineStoppedError("the engine is not started")

    def cut_open_requests(self, reason: str = "the server shut down before the request finished") -> None:
        """End every open request now with EngineStoppedError(reason), e.g. when the drain timeout ran out.
        Any thread."""
        self._command(_Cut(reason))

    def _command(self, command: _Add | _Abort | _Call | _Cut) -> None:
        with self._cond:
            self._commands.append(command)
            self._cond.notify()

    # ----------------------------------------------------------------------------------- engine thread

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._commands and not self.engine.has_unfinished_requests():
                        if self._stopping:
                            return
                        self._cond.wait(timeout=self.log_interval or None)
                        self._maybe_log()
                    commands, self._commands = self._commands, []
                    stopping = self._stopping
                for command in commands:
                    self._apply(command)
                if stopping:
                    error = EngineStoppedError("the server shut down before the request finished")
                    self._fail_open_requests(error, abort=True)
                    return
                if self.engine.has_unfinished_requests():
                    steps = self.engine.stats["steps"]
                    outputs = self.engine.step()
                    self._route(outputs)
                    if self.engine.stats["steps"] == steps:
                        # Nothing could be scheduled (memory full): wait a moment for an abort or a finish.
                        with self._cond:
                            if not self._commands:
                                self._cond.wait(timeout=0.001)
                self._update_snapshot()
                self._maybe_log()
        except BaseException as exc:  # the step failed: the engine state can no longer be trusted
            self._die(exc)
        finally:
            self._answer_late_commands()

    def _answer_late_commands(self) -> None:
        """Commands that arrived as the thread stopped: calls run here, adds are refused."""
        with self._cond:
            commands, self._commands = self._commands, []
        for command in commands:
            if isinstance(command, _Call):
                try:
                    command.done.set_result(command.fn(self.engine))
                except Exception as exc:
                    command.done.set_exception(exc)
            elif isinstance(command, _Add):
                command.done.set_exception(self._dead or EngineStoppedError("the engine has stopped"))

    def _apply(self, command: _Add | _Abort | _Call | _Cut) -> None:
        if isinstance(command, _Cut):
            self._fail_open_requests(EngineStoppedError(command.reason), abort=True)
        elif isinstance(command, _Abort):
            entry = self._streams.pop(command.request_id, None)
            self.engine.abort_request(command.request_id)
            if entry is not None:
                self._finished(*entry, None)
        elif isinstance(command, _Call):
            try:
                command.done.set_result(command.fn(self.engine))
            except Exception as exc:
                command.done.set_exception(exc)
        else:
            self._add(command)

    def _add(self, command: _Add) -> None:
        stream, done = command.stream, command.done
        if not self._accepting:
            done.set_exception(EngineStoppedError("the server is shutting down and takes no new requests"))
            return
        limit = self.max_waiting_requests
        wanted = len(command.inputs) * stream.params.n
        if limit is not None and wanted > limit:
            done.set_exception(
                RequestError(
                    f"the request asks for {wanted} sequences (prompts x n); "
                    f"this server queues at most {limit}",
                    param="n",
                )
            )
            return
        if limit is not None and self.engine.scheduler.num_waiting + wanted > limit:
            message = (
                f"the server is busy: {self.engine.scheduler.num_waiting} sequences are waiting; retry later"
            )
            done.set_exception(EngineOverloadedError(message))
            return
        added: list[str] = []
        try:
            for rid, item in zip(stream.request_ids, command.inputs, strict=True):
                self.engine.add_request(
                    rid,
                    item.prompt,
                    stream.params,
                    prompt_token_ids=item.prompt_token_ids,
                    cache_salt=item.cache_salt,
                )
                added.append(rid)
        except Exception as exc:  # RequestError for bad input; anything else fails this request only
            for rid in added:
                self.engine.abort_request(rid)
            done.set_exception(exc)
            return
        for index, rid in enumerate(stream.request_ids):
            self._streams[rid] = (stream, index)
        done.set_result(None)

    def _route(self, outputs: list[RequestOutput]) -> None:
        items: list[tuple[RequestStream, Any]] = []
        for output in outputs:
            entry = self._streams.get(output.request_id)
            if entry is None:
                continue
            stream, index = entry
            count = sum(len(o.token_ids) for o in output.outputs)
            delta = stream.params.output_kind is RequestOutputKind.DELTA
            stream.num_output_tokens[index] = count + (stream.num_output_tokens[index] if delta else 0)
            if output.finished:
                del self._streams[output.request_id]
                self._finished(stream, index, output)
            items.append((stream, (index, output)))
        deliver(items)

    def _finished(self, stream: RequestStream, index: int, output: RequestOutput | None) -> None:
        """Tell the listener; ``output`` None means the request was aborted or cut."""
        if self.listener is None:
            return
        now = time.monotonic()
        metrics = output.metrics if output is not None else None
        try:
            self.listener.request_finished(
                FinishedRequest(
                    request_id=stream.request_ids[index],
                    num_prompt_tokens=len(output.prompt_token_ids) if output is not None else 0,
                    num_output_tokens=stream.num_output_tokens[index],
                    n=stream.params.n,
                    finish_reasons=tuple(o.finish_reason for o in output.outputs) if output else ("abort",),
                    arrival_time=metrics.arrival_time if metrics else now,
                    first_token_time=metrics.first_token_time if metrics else None,
                    finished_time=(metrics.finished_time or now) if metrics else now,
                )
            )
        except Exception:  # statistics must never take the engine down
            logger.exception("stats listener failed")

    def _fail_open_requests(self, error: BaseException, *, abort: bool) -> None:
        """End every open stream with ``error``; ``abort`` also frees their engine requests (the engine is
        trusted still); a dead engine's requests are left as they are."""
        streams: dict[int, RequestStream] = {}
        for rid, (stream, index) in self._streams.items():
            if abort:
                self.engine.abort_request(rid)
                self._finished(stream, index, None)
            streams[id(stream)] = stream
        self._streams.clear()
        deliver([(stream, error) for stream in streams.values()])

    def _die(self, exc: BaseException) -> None:
        logger.error("the engine loop failed; failing every open request", exc_info=exc)
        self._dead = EngineDeadError(f"the engine stopped after an internal error ({type(exc).__name__})")
        # Mark the snapshot dead before waking the clients, so what they read next (/metrics) agrees.
        self._snapshot = replace(self._snapshot, alive=False, open_requests=0)
        self._fail_open_requests(self._dead, abort=False)

    def _update_snapshot(self) -> None:
        engine = self.engine
        queries, hits = engine.buffers.prefix_cache_stats
        self._snapshot = EngineSnapshot(
            alive=self._dead is None,
            accepting=self._accepting,
            num_running=engine.scheduler.num_running,
            num_waiting=engine.scheduler.num_waiting,
            kv_cache_usage=engine.buffers.usage(),
            prompt_tokens=engine.stats["prompt_tokens"],
            generation_tokens=engine.stats["generation_tokens"],
            steps=engine.stats["steps"],
            open_requests=len(self._streams),
            prefix_cache_queries=queries,
            prefix_cache_hits=hits,
        )

    def _maybe_log(self) -> None:
        """One status line every ``log_interval`` seconds, unless nothing at all happened in it."""
        now = time.monotonic()
        last_time, last_prompt, last_gen, last_queries, last_hits = self._last_log
        if not self.log_interval or now - last_time < self.log_interval:
            return
        snap = self._snapshot
        queries, hits = snap.prefix_cache_queries, snap.prefix_cache_hits
        self._last_log = (now, snap.prompt_tokens, snap.generation_tokens, queries, hits)
        if not (snap.num_running or snap.num_waiting or snap.generation_tokens != last_gen):
            return
        elapsed = now - last_time
        # The hit rate over the interval's admissions (the cumulative rate when none was admitted).
        window = queries - last_queries
        rate = (hits - last_hits) / window if window else snap.prefix_cache_hit_rate
        logger.info(
            "engine: prompt %.1f tok/s, generation %.1f tok/s, running %d, waiting %d, KV pages %.1f%%, "
            "prefix cache hit rate %.1f%%",
            (snap.prompt_tokens - last_prompt) / elapsed,
            (snap.generation_tokens - last_gen) / elapsed,
            snap.num_running,
            snap.num_waiting,
            100.0 * snap.kv_cache_usage,
            100.0 * rate,
        )
