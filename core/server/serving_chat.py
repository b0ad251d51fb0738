"""POST /v1/chat/completions: messages rendered with the checkpoint's chat template, then generated."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pegainfer.engine.async_engine import AsyncLLMEngine
from pegainfer.engine.outputs import CompletionOutput, RequestOutput
from pegainfer.engine.request_stream import PromptInput, RequestStream
from pegainfer.errors import RequestError
from pegainfer.sampling.sampling_params import SamplingParams
from pegainfer.server.forced_tools import forced_calls, forced_name, forces_calls
from pegainfer.server.protocol import ChatCompletionRequest
from pegainfer.server.reasoning import THINK_END, ReasoningStream, opens_thinking, split_reasoning
from pegainfer.server.serving import ServingBase, chat_logprobs, created, has_news, usage
from pegainfer.server.streaming import sse, sse_response
from pegainfer.server.tool_calls import ToolCallFormat, ToolCallStream, split_tool_calls, tool_call_format


class ChatServing(ServingBase):
    """``reasoning``: answers are split into reasoning and content (``server.reasoning_parser``)."""

    id_prefix = "chatcmpl"

    def __init__(self, engine: AsyncLLMEngine, model_names: list[str], reasoning: bool = False) -> None:
        super().__init__(engine, model_names)
        self.reasoning = reasoning

    async def create(self, body: ChatCompletionRequest, raw: Request) -> Response:
        self.check_request(body)
        text = self.render_chat(body)
        inputs = [PromptInput(self.encode(text, add_special_tokens=False), text, body.cache_salt)]
        params = self.sampling_params(body, body.requested_max_tokens, body.num_logprobs)
        request_id = self.new_id()
        tools = self._tool_call_format(body)
        if tools is not None and tools.special_tokens:
            params.skip_special_tokens = False  # the calls' markers are special tokens
        thinking = self._thinking(body, text, params)
        stream = await self.submit(request_id, inputs, params)
        if body.stream:
            prompt_tokens = len(inputs[0].prompt_token_ids)
            return sse_response(self._events(body, request_id, stream, tools, prompt_tokens, thinking))
        finals = await self.collect(stream, raw)
        return JSONResponse(self._response(body, request_id, finals[0], tools, thinking))

    def _thinking(self, body: ChatCompletionRequest, prompt: str, params: SamplingParams) -> bool | None:
        """Whether the answer starts inside a think block (None: no reasoning split). Where it does, a
        grammar (structured outputs, a forced tool choice) starts after the block's ``</think>``, so the
        model reasons freely first; a grammar from the first token leaves no room for reasoning (all
        content), as when ``</think>`` is no single token of this vocabulary."""
        if not self.reasoning:
            return None
        think_end = self.tokenizer.encode(THINK_END, add_special_tokens=False)
        if params.skip_special_tokens and not self.tokenizer.decode(think_end):
            params.skip_special_tokens = False  # the tags are special tokens here: the split reads them
        continued = None  # the text the answer continues, where it continues one
        if body.continue_final_message:
            continued = body.messages[-1].for_template().get("content") or ""
        opens = opens_thinking(prompt, continued)
        grammar = params.structured_outputs
        if grammar is None:
            return opens
        if not opens or len(think_end) != 1:
            return None
        params.structured_outputs = replace(grammar, after=THINK_END)
        return True

    def _tool_call_format(self, body: ChatCompletionRequest) -> ToolCallFormat | None:
        """The form whose blocks in the answer become ``tool_calls``: tools offered, not refused, and a
        template that asks for one (``tool_calls``); None: the answer stays text."""
        if not body.tools or body.tool_choice == "none" or forces_calls(body.tool_choice):
            return None  # a forced choice's answer is the calls by construction (forced_tools)
        try:
            return tool_call_format(self.tokenizer.chat_template_source(tools=body.tools))
        except RequestError:
            return None

    def _response(
        self,
        body: ChatCompletionRequest,
        request_id: str,
        output: RequestOutput,
        tools: ToolCallFormat | None,
        thinking: bool | None = None,
    ) -> dict[str, Any]:
        """``thinking``: None, the answer is all content; else whether it starts inside a think block."""
        choices = []
        for completion in output.outputs:
            reasoning, text = None, completion.text
            if thinking is not None:
                reasoning, text = split_reasoning(text, thinking)
            message: dict[str, Any] = {"role": "assistant", "content": text}
            finish = completion.finish_reason
            # A block that never closed (cut, or ended by EOS or a stop) made no call: reasoning only.
            forced = _forced(body, text, finish) if text is not None else None
            if forced is not None:
                message, finish = {"role": "assistant", "content": None, "tool_calls": forced[0]}, forced[1]
            elif tools is not None and text:
                content, calls = split_tool_calls(text, tools, _max_calls(body))
                if calls:
                    message = {"role": "assistant", "content": content or None, "tool_calls": calls}
                    finish = _finish_with_calls(finish)
            if reasoning and body.include_reasoning:
                message.update(_reasoning_fields(reasoning))
            choices.append(
                {
                    "index": completion.index,
                    "message": message,
                    "logprobs": self._logprobs(body, completion),
                    "finish_reason": finish,
                    "stop_reason": completion.stop_reason,
                }
            )
        completion_tokens = sum(len(c.token_ids) for c in output.outputs)
        return {
            "id": request_id,
            "object": "chat.completion",
            "created": created(),
            "model": self.model_name,
            "choices": choices,
            "usage": usage(len(output.prompt_token_ids), completion_tokens, output.num_cached_tokens),
        }

    @staticmethod
    def _logprobs(body: ChatCompletionRequest, completion: CompletionOutput) -> dict[str, Any] | None:
        k = body.num_logprobs
        if k is None or completion.logprobs is None:
            return None
        return chat_logprobs(completion.token_ids, completion.logprobs, k)

    async def _events(
        self,
        body: ChatCompletionRequest,
        request_id: str,
        stream: RequestStream,
        tools: ToolCallFormat | None,
        prompt_tokens: int,
        thinking: bool | None = None,
    ) -> AsyncIterator[str]:
        stamp = created()
        include_usage = body.include_usage
        splitters: dict[int, ReasoningStream] = {}
        parsers: dict[int, ToolCallStream] = {}
        calls_made: dict[int, int] = {}
        forcing = forces_calls(body.tool_choice)
        named = forced_name(body.tool_choice) if forcing else None
        held: dict[int, str] = {}
        opened: set[int] = set()

        def base(choices: list[dict[str, Any]]) -> dict[str, Any]:
            chunk = {
                "id": request_id,
                "object": "chat.completion.chunk",
                "created": stamp,
                "model": self.model_name,
                "choices": choices,
            }
            if include_usage:
                chunk["usage"] = None
            return chunk

        def chunks(choice: int, completion: CompletionOutput, output: RequestOutput) -> list[dict[str, Any]]:
            if not has_news(completion):
                return []
            text, calls, finish = completion.text, [], completion.finish_reason
            reasoning = ""
            if thinking is not None:
                splitter = splitters.setdefault(choice, ReasoningStream(thinking))
                reasoning, text = splitter.feed(text)
                if finish is not None:
                    more_reasoning, more_text = splitter.finish()
                    reasoning, text = reasoning + more_reasoning, text + more_text
            if not body.include_reasoning:
                reasoning = ""
            if named is not None:  # the text is the arguments: the call opens, then its arguments stream
                opens = thinking is None or (splitters[choice].in_content and (text or finish))
                if choice not in opened and opens:  # once past any reasoning
                    opened.add(choice)
                    [call] = forced_calls(text, body.tool_choice)
                    calls = [{"index": 0, **call}]
                elif text:
                    calls = [{"index": 0, "function": {"arguments": text}}]
                text = ""
                if not (calls or reasoning or finish or completion.logprobs):
                    return []
            elif forcing:  # a "required" list is held whole: its calls are known once it ends
                held[choice] = held.get(choice, "") + text
                text = ""
                forced = _forced(body, held[choice], finish) if finish is not None else None
                if forced is not None:
                    calls = [{"index": i, **call} for i, call in enumerate(forced[0])]
                    finish = forced[1]
                elif finish is not None:
                    text = held[choice]  # a cut list: no calls, the text as it is
                if not (text or reasoning or calls or finish or completion.logprobs):
                    return []
            elif tools is not None:
                parser = parsers.setdefault(choice, ToolCallStream(tools, _max_calls(body)))
                text, calls = parser.feed(text)
                if finish is not None:
                    rest, more = parser.finish()
                    text, calls = text + rest, calls + more
                first = calls_made.get(choice, 0)
                calls = [{"index": first + i, **call} for i, call in enumerate(calls)]
                calls_made[choice] = first + len(calls)
                if calls_made[choice]:
                    finish = _finish_with_calls(finish)
            if not (text or reasoning or calls or finish or completion.logprobs):
                return []  # held back: the start of a tool call or a tag, or reasoning left out
            delta: dict[str, Any] = _reasoning_fields(reasoning) if reasoning else {}
            if text:
                delta["content"] = text
            if calls:
                delta["tool_calls"] = calls
            item = {
                "index": choice,
                "delta": delta,
                "logprobs": self._logprobs(body, completion),
                "finish_reason": finish,
                "stop_reason": completion.stop_reason,
            }
            return [base([item])]

        def usage_chunk(counts: dict[str, int]) -> dict[str, Any]:
            return {**base([]), "usage": counts}

        # Every choice opens with the assistant role, before any content (as OpenAI streams it).
        try:
            for i in range(body.n):
                role = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
                chunk = base([{**role, "finish_reason": None}])
                if body.continuous_usage:  # before any token: the prompt's (its cached part not yet known)
                    chunk["usage"] = usage(prompt_tokens, 0)
                yield sse(chunk)
            usage_of = usage_chunk if include_usage else None
            async for event in self.stream_events(stream, chunks, usage_of, body.continuous_usage):
                yield event
        finally:
            stream.abort()  # a no-op once finished; frees the pages at once when the client left


def _forced(body: ChatCompletionRequest, text: str, finish: str | None) -> tuple[list, str | None] | None:
    """(tool calls, finish reason) of an answer a forced ``tool_choice`` shaped, or None (nothing forced,
    or a cut "required" list): a named function finishes as OpenAI's does ("stop"), a required list with
    "tool_calls"."""
    if not forces_calls(body.tool_choice):
        return None
    calls = forced_calls(text, body.tool_choice)
    if calls is None:
        return None
    return calls, finish if forced_name(body.tool_choice) is not None else _finish_with_calls(finish)


def _reasoning_fields(reasoning: str) -> dict[str, str]:
    """The reasoning under both names clients read: ``reasoning_content`` (DeepSeek's API, vLLM before
    0.11) and ``reasoning`` (vLLM's since)."""
    return {"reasoning_content": reasoning, "reasoning": reasoning}


def _finish_with_calls(finish: str | None) -> str | None:
    """OpenAI's finish reason for an answer that made tool calls: "tool_calls" where it stopped by itself."""
    return "tool_calls" if finish == "stop" else finish


def _max_calls(body: ChatCompletionRequest) -> int | None:
    """The most tool calls an answer gives: one where ``parallel_tool_calls`` is false."""
    return 1 if body.parallel_tool_calls is False else None
