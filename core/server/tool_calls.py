"""Tool calls in generated text: the Hermes form, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
which the Qwen chat templates (Qwen2.5, Qwen3, Qwen3.5) tell the model to write.

A chat request with ``tools`` (and ``tool_choice`` not "none") to a model whose template speaks this form
gets OpenAI's ``tool_calls`` in place of those blocks: :func:`split_tool_calls` for a whole answer,
:class:`ToolCallStream` for a streamed one, where text that may still turn into a block is held back
until it is known. A block whose body is not a JSON object with a string ``name`` stays text, as the
model wrote it: a malformed call is the client's to see, not to lose.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def speaks_hermes(template_source: str) -> bool:
    """Whether a chat template asks for Hermes tool calls (it names the tag it wants back)."""
    return OPEN in template_source


def _call(body: str) -> dict[str, Any] | None:
    """OpenAI's tool call for a block's body, or None when it is not a call."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
        return None
    arguments = parsed.get("arguments", {})
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {
            "name": parsed["name"],
            "arguments": arguments
            if isinstance(arguments, str)
            else json.dumps(arguments, ensure_ascii=False),
        },
    }


def split_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """(the text outside the tool-call blocks, the calls in order) of a whole answer."""
    stream = ToolCallStream()
    content, calls = stream.feed(text)
    rest, more = stream.finish()
    return content + rest, calls + more


class ToolCallStream:
    """Streamed text in, (content delta, completed calls) out: a block's text is held until its closing
    tag; text that could be the start of an opening tag waits for the next delta."""

    def __init__(self) -> None:
        self._pending = ""  # text not yet sent: a partial opening tag, or an open block
        self._in_block = False

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        self._pending += delta
        content: list[str] = []
        calls: list[dict[str, Any]] = []
        while True:
            if self._in_block:
                end = self._pending.find(CLOSE)
                if end < 0:
                    break
                body = self._pending[:end]
                call = _call(body.strip())
                if call is None:
                    content.append(OPEN + body + CLOSE)
                else:
                    calls.append(call)
                self._pending = self._pending[end + len(CLOSE) :]
                self._in_block = False
                continue
            start = self._pending.find(OPEN)
            if start >= 0:
                content.append(self._pending[:start])
                self._pending = self._pending[start + len(OPEN) :]
                self._in_block = True
                continue
            keep = _partial_tag(self._pending)
            content.append(self._pending[: len(self._pending) - keep])
            self._pending = self._pending[len(self._pending) - keep :]
            break
        return "".join(content), calls

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """What is left when the answer ends: an unclosed block or a partial tag is text."""
        rest = (OPEN if self._in_block else "") + self._pending
        self._pending, self._in_block = "", False
        return rest, []


def _partial_tag(text: str) -> int:
    """The length of the longest end of ``text`` that begins the opening tag."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0
