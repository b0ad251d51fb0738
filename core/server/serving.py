"""What the endpoints share: model-name checks, prompt encoding, submission, usage and logprobs formats."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request

from pegainfer.engine.async_engine import AsyncLLMEngine
from pegainfer.engine.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from pegainfer.engine.request_stream import EngineDeadError, EngineStoppedError, PromptInput, RequestStream
from pegainfer.errors import RequestError
from pegainfer.sampling.sampling_params import SamplingParams
from pegainfer.server.errors import APIError, to_api_error
from pegainfer.server.protocol import _ChatPrompt, _SamplingFields, _TokenizeFields
from pegainfer.server.streaming import DONE, ClientDisconnected, collect_until_disconnect, sse

# Names apply_chat_template takes itself; chat_template_kwargs may not override them.
_RESERVED_TEMPLATE_KWARGS = {"messages", "tools", "add_generation_prompt", "chat_template"}

# JSON has no -inf; OpenAI-compatible servers report impossible tokens with this floor instead.
_LOGPROB_FLOOR = -9999.0


def finite(logprob: float) -> float:
    return logprob if logprob > _LOGPROB_FLOOR else _LOGPROB_FLOOR


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; ``cached_tokens``: prompt tokens served from the prefix cache."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def top_entries(entry: PositionLogprobs, k: int) -> list[tuple[int, Any]]:
    """The ``k`` most likely (id, Logprob) pairs of one position, best first."""
    return sorted(entry.items(), key=lambda item: -item[1].logprob)[:k]


def completion_logprobs(
    token_ids: list[int],
    entries: list[PositionLogprobs | None],
    k: int,
    offset: int,
    decode: Callable[[int], str] | None = None,
) -> dict[str, Any]:
    """The completions API's logprobs object for ``token_ids``; text offsets start at ``offset``.

    A position without logprobs (``None``: the first prompt token, which nothing predicts) is reported as
    OpenAI and vLLM report it: its text (from ``decode``), ``None`` logprob and ``None`` top logprobs.
    """
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for token_id, entry in zip(token_ids, entries, strict=False):
        if entry is None:
            text = decode(token_id) if decode is not None else ""
            tokens.append(text)
            token_logprobs.append(None)
            tops.append(None)
        else:
            chosen = entry[token_id]
            text = chosen.decoded_token or ""
            tokens.append(text)
            token_logprobs.append(finite(chosen.logprob))
            top = {lp.decoded_token or "": finite(lp.logprob) for _, lp in top_entries(entry, k)}
            top.setdefault(text, finite(chosen.logprob))
            tops.append(top)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(token_ids: list[int], entries: list[PositionLogprobs], k: int) -> dict[str, Any]:
    """The chat API's logprobs object (``{"content": [...]}``) for ``token_ids``."""

    def item(text: str, logprob: float) -> dict[str, Any]:
        return {"token": text, "logprob": finite(logprob), "bytes": list(text.encode("utf-8", "replace"))}

    content = []
    for token_id, entry in zip(token_ids, entries, strict=False):
        chosen = entry[token_id]
        record = item(chosen.decoded_token or "", chosen.logprob)
        record["top_logprobs"] = [item(lp.decoded_token or "", lp.logprob) for _, lp in top_entries(entry, k)]
        content.append(record)
    return {"content": content, "refusal": None}


class ServingBase:
    """Turns validated request bodies into engine submissions, for one served model."""

    id_prefix = "req"

    def __init__(self, engine: AsyncLLMEngine, model_names: list[str]) -> None:
        self.engine = engine
        llm = engine.engine
        self.tokenizer = llm.tokenizer
        self.defaults: SamplingParams = llm.default_sampling_params()
        self.max_model_len = llm.max_model_len
        self.vocab_size = int(llm.executor.info.vocab_size or self.tokenizer.vocab_size)
        self.model_names = model_names
        self.model_name = model_names[0]

    def new_id(self) -> str:
        return f"{self.id_prefix}-{uuid.uuid4().hex}"

    def check_request(self, body: _SamplingFields | _TokenizeFields) -> None:
        """404 for another model's name, 400 for what the body asks that is not served."""
        self.check_model(body.model)
        try:
            body.check_supported()
        except RequestError as exc:
            raise to_api_error(exc) from None

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            # OpenAI's answer for an unknown model: 404, type invalid_request_error, code model_not_found.
            raise APIError(
                404,
                f"The model '{model}' does not exist; this server serves '{self.model_name}'",
                type="invalid_request_error",
                param="model",
                code="model_not_found",
            )

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        try:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        except Exception:  # e.g. lone surrogates, which JSON can carry but text cannot
            raise APIError(400, "the prompt could not be tokenized", param="prompt") from None

    def render_chat(self, body: _ChatPrompt) -> str:
        """The prompt text, rendered as transformers renders it (the template adds the special tokens)."""
        kwargs = dict(body.chat_template_kwargs or {})
        reserved = sorted(_RESERVED_TEMPLATE_KWARGS & kwargs.keys())
        if reserved:
            raise APIError(
                400, f"chat_template_kwargs may not set {', '.join(reserved)}", param="chat_template_kwargs"
            )
        messages = [m.for_template() for m in body.messages]
        try:
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=body.add_generation_prompt, tools=body.tools, **kwargs
            )
        except RequestError as exc:
            raise to_api_error(exc) from None
        except Exception:  # a template that breaks on unusual input is a bad request, not a crash
            raise APIError(
                400, "the chat template could not render these messages", param="messages"
            ) from None
        if body.continue_final_message:
            # Cut after the final message's text, so the model continues it instead of closing the turn.
            final = messages[-1].get("content") or ""
            cut = text.rfind(final) if final else -1
            if cut >= 0:
                text = text[: cut + len(final)]
        return text

    def sampling_params(
        self,
        body: _SamplingFields,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        try:
            return body.sampling_params(
                self.defaults,
                max_tokens=max_tokens,
                logprobs=logprobs,
                vocab_size=self.vocab_size,
                prompt_logprobs=prompt_logprobs,
            )
        except RequestError as exc:
            raise to_api_error(exc) from None

    async def submit(
        self, request_id: str, inputs: list[PromptInput], params: SamplingParams
    ) -> RequestStream:
        try:
            return await self.engine.submit(request_id, inputs, params)
        except Exception as exc:
            raise to_api_error(exc) from None

    async def collect(self, stream: RequestStream, raw: Request) -> dict[int, RequestOutput]:
        """Final outputs by prompt index; 500 when a sequence failed inside the engine."""
        try:
            finals = await collect_until_disconnect(stream, raw)
        except ClientDisconnected:
            raise APIError(499, "the client closed the connection", code="client_closed") from None
        except Exception as exc:
            raise _in_flight_error(exc) from None
        for output in finals.values():
            if any(c.finish_reason == "error" for c in output.outputs):
                raise APIError(500, "the request failed inside the engine", code="internal_error")
        return finals

    async def stream_events(
        self,
        stream: RequestStream,
        chunks: Any,
        usage_chunk: Any | None,
        continuous_usage: bool = False,
    ) -> AsyncIterator[str]:
        """SSE events: ``chunks(index, completion, output)`` gives each output's chunk dicts, then a usage
        chunk when asked, then ``[DONE]``. ``continuous_usage`` (with a ``usage_chunk``): every chunk also
        carries the usage so far, as vLLM's ``stream_options.continuous_usage_stats`` does. An engine
        failure becomes an error event; leaving aborts."""
        n = stream.params.n
        sent_finish: set[int] = set()
        prompt_tokens: dict[int, int] = {}
        cached_tokens: dict[int, int] = {}
        completion_tokens = 0

        def counts() -> dict[str, Any]:  # the usage so far
            return usage(sum(prompt_tokens.values()), completion_tokens, sum(cached_tokens.values()))

        try:
            async for index, output in stream:
                prompt_tokens.setdefault(index, len(output.prompt_token_ids))
                cached_tokens[index] = output.num_cached_tokens
                for completion in output.outputs:
                    choice = index * n + completion.index
                    if choice in sent_finish:
                        continue
                    if completion.finish_reason == "error":
                        error = APIError(500, "the request failed inside the engine", code="internal_error")
                        yield sse(error.body())
                        return
                    completion_tokens += len(completion.token_ids)
                    if completion.finish_reason is not None:
                        sent_finish.add(choice)
                    for chunk in chunks(choice, completion, output):
                        if continuous_usage and usage_chunk is not None:
                            chunk["usage"] = usage_chunk(counts())["usage"]
                        yield sse(chunk)
            if usage_chunk is not None:
                yield sse(usage_chunk(counts()))
            yield DONE
        except (EngineDeadError, EngineStoppedError) as exc:
            yield sse(_in_flight_error(exc).body())
        finally:
            stream.abort()


def _in_flight_error(exc: BaseException) -> APIError:
    """An admitted request cut by the engine dying or the server stopping is a server error (500)."""
    if isinstance(exc, (EngineDeadError, EngineStoppedError)):
        return APIError(
            500, str(exc), code="engine_dead" if isinstance(exc, EngineDeadError) else "shutting_down"
        )
    return to_api_error(exc)


def created() -> int:
    return int(time.time())


def has_news(completion: CompletionOutput) -> bool:
    return bool(completion.text or completion.finish_reason or completion.logprobs)
