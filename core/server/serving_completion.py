"""POST /v1/completions.

``echo`` with ``logprobs`` also reports the prompt's tokens, as OpenAI's legacy completions and vLLM do
(what lm-evaluation-harness's ``local-completions`` loglikelihood requests read): ``choices[i].logprobs``
covers the prompt tokens, then the generated ones; the first prompt token has no logprob (``None``).
``max_tokens`` 0 is allowed with ``echo``: the answer is the prompt alone.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pegainfer.engine.outputs import CompletionOutput, RequestOutput
from pegainfer.engine.request_stream import PromptInput
from pegainfer.errors import RequestError
from pegainfer.server.errors import APIError, to_api_error
from pegainfer.server.protocol import CompletionRequest
from pegainfer.server.serving import ServingBase, completion_logprobs, created, has_news, usage
from pegainfer.server.streaming import sse_response


class CompletionServing(ServingBase):
    id_prefix = "cmpl"

    async def create(self, body: CompletionRequest, raw: Request) -> Response:
        self.check_request(body)
        try:
            prompts = body.prompts()
        except RequestError as exc:
            raise to_api_error(exc) from None
        inputs = [
            PromptInput(self.encode(p), p, body.cache_salt)
            if isinstance(p, str)
            else PromptInput(list(p), None, body.cache_salt)
            for p in prompts
        ]
        # The engine generates at least one token per sequence, so max_tokens 0 (allowed with echo only)
        # generates one and the answer drops it: only the prompt, and its logprobs, are returned.
        drop_generated = body.max_tokens == 0
        max_tokens = 1 if drop_generated else body.max_tokens
        params = self.sampling_params(body, max_tokens, body.logprobs, body.prompt_logprobs)
        request_id = self.new_id()
        echo = [self._prompt_text(i) for i in inputs] if body.echo else None
        stream = await self.submit(request_id, inputs, params)
        if body.stream:
            return sse_response(self._events(body, request_id, stream, echo, drop_generated))
        finals = await self.collect(stream, raw)
        return JSONResponse(self._response(body, request_id, finals, echo, drop_generated))

    def _prompt_text(self, item: PromptInput) -> str:
        if item.prompt is not None:
            return item.prompt
        if any(not 0 <= t < self.vocab_size for t in item.prompt_token_ids):
            raise APIError(400, f"prompt token ids must be in [0, {self.vocab_size})", param="prompt")
        return self.tokenizer.decode(item.prompt_token_ids)

    def _token_text(self, token_id: int) -> str:
        # As the engine decodes the tokens of logprobs entries: one token alone, special tokens kept.
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _response(
        self,
        body: CompletionRequest,
        request_id: str,
        finals: dict[int, RequestOutput],
        echo: list[str] | None,
        drop_generated: bool,
    ) -> dict[str, Any]:
        choices = []
        prompt_tokens = completion_tokens = cached_tokens = 0
        n = body.n
        for index in sorted(finals):
            output = finals[index]
            prompt_tokens += len(output.prompt_token_ids)
            cached_tokens += output.num_cached_tokens
            for completion in output.outputs:
                completion = _visible(completion, drop_generated)
                completion_tokens += len(completion.token_ids)
                prefix = echo[index] if echo else ""
                choices.append(
                    {
                        "index": index * n + completion.index,
                        "text": prefix + completion.text,
                        "logprobs": self._logprobs(body, output, completion, len(prefix), echo is not None),
                        "finish_reason": completion.finish_reason,
                        "stop_reason": completion.stop_reason,
                    }
                )
        return {
            "id": request_id,
            "object": "text_completion",
            "created": created(),
            "model": self.model_name,
            "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens, cached_tokens),
        }

    def _logprobs(
        self,
        body: CompletionRequest,
        output: RequestOutput,
        completion: CompletionOutput,
        offset: int,
        with_prompt: bool,
    ) -> dict[str, Any] | None:
        """The logprobs object of ``completion``; ``with_prompt``: the prompt's tokens first (echo), their
        text offsets from the start of the echoed text, as vLLM counts them."""
        if body.logprobs is None:
            return None
        if not with_prompt:
            if completion.logprobs is None:
                return None
            return completion_logprobs(completion.token_ids, completion.logprobs, body.logprobs, offset)
        prompt = output.prompt_logprobs
        if prompt is None or len(prompt) != len(output.prompt_token_ids):
            raise RuntimeError(f"request {output.request_id}: the engine returned no prompt logprobs")
        return completion_logprobs(
            [*output.prompt_token_ids, *completion.token_ids],
            [*prompt, *(completion.logprobs or [])],
            body.logprobs,
            0,
            decode=self._token_text,
        )

    def _events(
        self,
        body: CompletionRequest,
        request_id: str,
        stream: Any,
        echo: list[str] | None,
        drop_generated: bool,
    ):
        stamp = created()
        include_usage = body.include_usage
        started: set[int] = set()
        offsets: dict[int, int] = {}

        def base(choices: list[dict[str, Any]]) -> dict[str, Any]:
            chunk = {
                "id": request_id,
                "object": "text_completion",
                "created": stamp,
                "model": self.model_name,
                "choices": choices,
            }
            if include_usage:
                chunk["usage"] = None
            return chunk

        def chunks(choice: int, completion: CompletionOutput, output: RequestOutput) -> list[dict[str, Any]]:
            completion = _visible(completion, drop_generated)
            first = choice not in started
            started.add(choice)
            text = completion.text
            if echo and first:
                text = echo[choice // body.n] + text
            if not (text or has_news(completion)):
                return []
            offset = offsets.get(choice, 0)
            logprobs = self._logprobs(body, output, completion, offset, echo is not None and first)
            offsets[choice] = offset + len(text)
            item = {
                "index": choice,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": completion.finish_reason,
                "stop_reason": completion.stop_reason,
            }
            return [base([item])]

        def usage_chunk(counts: dict[str, int]) -> dict[str, Any]:
            if drop_generated:
                counts = usage(counts["prompt_tokens"], 0, counts["prompt_tokens_details"]["cached_tokens"])
            return {**base([]), "usage": counts}

        return self.stream_events(
            stream, chunks, usage_chunk if include_usage else None, body.continuous_usage
        )


def _visible(completion: CompletionOutput, drop_generated: bool) -> CompletionOutput:
    """What the client sees of ``completion``: with max_tokens 0, none of the token generated to get there
    (no text, no tokens, no logprobs), and a "length" finish once the sequence is done."""
    if not drop_generated:
        return completion
    return replace(
        completion,
        text="",
        token_ids=[],
        logprobs=None if completion.logprobs is None else [],
        cumulative_logprob=None,
        finish_reason="length" if completion.finish_reason is not None else None,
        stop_reason=None,
    )
