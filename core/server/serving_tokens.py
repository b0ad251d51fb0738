"""POST /tokenize and /detokenize (vLLM's extensions): the ids the generating endpoints would feed the
model for a prompt or a chat, and the text of ids, so clients can count and budget tokens exactly."""

from __future__ import annotations

from typing import Any

from pegainfer.server.errors import APIError
from pegainfer.server.protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest
from pegainfer.server.serving import ServingBase


class TokenServing(ServingBase):
    def tokenize(self, body: TokenizeCompletionRequest | TokenizeChatRequest) -> dict[str, Any]:
        self.check_request(body)
        text = body.prompt if isinstance(body, TokenizeCompletionRequest) else self.render_chat(body)
        ids = self.encode(text, add_special_tokens=body.add_special_tokens)
        return {
            "count": len(ids),
            "max_model_len": self.max_model_len,
            "tokens": ids,
            "token_strs": self.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None,
        }

    def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        self.check_model(body.model)
        size = self.tokenizer.vocab_size
        outside = next((i for i in body.tokens if i >= size), None)
        if outside is not None:
            raise APIError(400, f"token ids must be in [0, {size}), got {outside}", param="tokens")
        return {"prompt": self.tokenizer.decode(body.tokens, skip_special_tokens=False)}
