"""Chat answers built from fixed model text, with no engine: what the tool-call and reasoning tests give
``ChatServing``'s answer builders (whole and streamed)."""

from __future__ import annotations

from types import SimpleNamespace

from pegainfer.engine.outputs import CompletionOutput, RequestOutput
from pegainfer.server.serving_chat import ChatServing
from pegainfer.text.tiny_tokenizer import CHAT_TEMPLATE


def engineless_serving(reasoning: bool = False) -> ChatServing:
    """A ``ChatServing`` without an engine (only the answer's form is under test), on the tiny template."""
    serving = ChatServing.__new__(ChatServing)
    serving.model_name = "tiny"
    serving.tokenizer = SimpleNamespace(chat_template_source=lambda tools=None: CHAT_TEMPLATE)
    serving.reasoning = reasoning
    return serving


def text_output(text: str, finish: str | None = "stop") -> RequestOutput:
    """One completion of ``text`` (a whole answer, or a streamed piece while ``finish`` is None)."""
    return RequestOutput("r", None, [1, 2], [CompletionOutput(0, text, [3, 4], finish_reason=finish)], True)


class ReplayedStream:
    """A RequestStream's surface as ``stream_events`` reads it, replaying fixed outputs."""

    params = SimpleNamespace(n=1)

    def __init__(self, outputs: list[RequestOutput]) -> None:
        self._outputs = outputs

    async def __aiter__(self):
        for output in self._outputs:
            yield 0, output

    def abort(self) -> None:
        pass
