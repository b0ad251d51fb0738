"""POST /v1/completions."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pegainfer.errors import RequestError
from pegainfer.outputs import CompletionOutput, RequestOutput
from pegainfer.request_stream import PromptInput
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
            PromptInput(self.encode(p), p) if isinstance(p, str) else PromptInput(list(p), None)
            for p in prompts
        ]
        params = self.sampling_params(body, body.max_tokens, body.logprobs)
        request_id = self.new_id()
        echo = [self._prompt_text(i) for i in inputs] if body.echo else None
        stream = await self.submit(request_id, inputs, params)
        if body.stream:
            return sse_response(self._events(body, request_id, stream, echo))
        finals = await self.collect(stream, raw)
        return JSONResponse(self._response(body, request_id, finals, echo))

    def _prompt_text(self, item: PromptInput) -> str:
        if item.prompt is not None:
            return item.prompt
        if any(not 0 <= t < self.vocab_size for t in item.prompt_token_ids):
            raise APIError(400, f"prompt token ids must be in [0, {self.vocab_size})", param="prompt")
        return self.tokenizer.decode(item.prompt_token_ids)

    def _response(
        self,
        body: CompletionRequest,
        request_id: str,
        finals: dict[int, RequestOutput],
        echo: list[str] | None,
    ) -> dict[str, Any]:
        choices = []
        prompt_tokens = completion_tokens = 0
        n = body.n
        for index in sorted(finals):
            output = finals[index]
            prompt_tokens += len(output.prompt_token_ids)
            for completion in output.outputs:
                completion_tokens += len(completion.token_ids)
                prefix = echo[index] if echo else ""
                choices.append(
                    {
                        "index": index * n + completion.index,
                        "text": prefix + completion.text,
                        "logprobs": self._logprobs(body, completion, len(prefix)),
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
            "usage": usage(prompt_tokens, completion_tokens),
        }

    @staticmethod
    def _logprobs(
        body: CompletionRequest, completion: CompletionOutput, offset: int
    ) -> dict[str, Any] | None:
        if body.logprobs is None or completion.logprobs is None:
            return None
        return completion_logprobs(completion.token_ids, completion.logprobs, body.logprobs, offset)

    def _events(self, body: CompletionRequest, request_id: str, stream: Any, echo: list[str] | None):
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
            text = completion.text
            if echo and choice not in started:
                text = echo[choice // body.n] + text
            started.add(choice)
            if not (text or has_news(completion)):
                return []
            logprobs = self._logprobs(body, completion, offsets.get(choice, 0))
            offsets[choice] = offsets.get(choice, 0) + len(text)
            item = {
                "index": choice,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": completion.finish_reason,
                "stop_reason": completion.stop_reason,
            }
            return [base([item])]

        def usage_chunk(counts: dict[str, int]) -> dict[str, Any]:
            return {**base([]), "usage": counts}

        return self.stream_events(stream, chunks, usage_chunk if include_usage else None)
