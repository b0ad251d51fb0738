"""Tool calls in generated text: ``<tool_call>...</tool_call>`` blocks, which the Qwen chat templates ask
for, with either body their templates teach: a JSON object ``{"name": ..., "arguments": {...}}`` (the
Hermes form: Qwen2.5, Qwen3) or XML-like tags ``<function=NAME><parameter=KEY>value</parameter>...
</function>`` (Qwen3.5, Qwen3-Coder).

A chat request with ``tools`` (and ``tool_choice`` not "none") to a model whose template speaks this form
gets OpenAI's ``tool_calls`` in place of those blocks: :func:`split_tool_calls` for a whole answer,
:class:`ToolCallStream` for a streamed one, where text that may still turn into a block is held back
until it is known, and so is trailing whitespace (an answer with calls drops what no text
follows, whole or streamed alike). A block left open
when the answer ends (a ``</tool_call>`` stop string, a length cut) is a call if its body is one. A
body that is neither form stays text, as the model wrote it: a malformed call is the client's to see,
not to lose.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def asks_for_tool_call_blocks(template_source: str) -> bool:
    """Whether a chat template asks for ``<tool_call>`` blocks (it names the tag it wants back)."""
    return OPEN in template_source


_FUNCTION = re.compile(r"\s*<function=([^>\s]+)>(.*?)</function>\s*", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


def _json_body(body: str) -> tuple[str, Any] | None:
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
        return None
    return parsed["name"], parsed.get("arguments")


def _xml_body(body: str) -> tuple[str, Any] | None:
    """``<function=NAME>`` with ``<parameter=KEY>value</parameter>`` pieces: a value that reads as JSON
    (a number, a list, an object, true...) keeps that type, any other is a string."""
    function = _FUNCTION.fullmatch(body)
    if function is None:
        return None
    arguments: dict[str, Any] = {}
    for key, value in _PARAMETER.findall(function.group(2)):
        try:
            arguments[key] = json.loads(value)
        except ValueError:
            arguments[key] = value
    return function.group(1), arguments


def _call(body: str) -> dict[str, Any] | None:
    """OpenAI's tool call for a block's body, or None when it is not a call."""
    parsed = _json_body(body.strip()) or _xml_body(body)
    if parsed is None:
        return None
    name, arguments = parsed
    if not isinstance(arguments, str):  # the JSON text of an object ({} where the model gave none)
        arguments = json.dumps({} if arguments is None else arguments, ensure_ascii=False)
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def split_tool_calls(text: str, max_calls: int | None = None) -> tuple[str, list[dict[str, Any]]]:
    """(the text outside the tool-call blocks, the calls in order) of a whole answer."""
    stream = ToolCallStream(max_calls)
    content, calls = stream.feed(text)
    rest, more = stream.finish()
    return content + rest, calls + more


class ToolCallStream:
    """Streamed text in, (content delta, completed calls) out: a block's text is held until its closing
    tag; text that could be the start of an opening tag waits for the next delta, and trailing whitespace
    for text that is not whitespace. ``max_calls`` (``parallel_tool_calls: false`` asks for one): calls past
    it are dropped."""

    def __init__(self, max_calls: int | None = None) -> None:
        self._left = max_calls  # calls still to give (None: no bound)
        self._pending = ""  # text not yet sent: a partial opening tag, or an open block
        self._in_block = False
        self._called = False
        self._space = ""  # trailing whitespace, sent only once text follows it

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
                call = _call(body)
                if call is None:
                    content.append(self._text(OPEN + body + CLOSE))
                else:
                    calls += self._take(call)
                    self._called = True
                self._pending = self._pending[end + len(CLOSE) :]
                self._in_block = False
                continue
            start = self._pending.find(OPEN)
            if start >= 0:
                content.append(self._text(self._pending[:start]))
                self._pending = self._pending[start + len(OPEN) :]
                self._in_block = True
                continue
            keep = _partial_tag(self._pending)
            content.append(self._text(self._pending[: len(self._pending) - keep]))
            self._pending = self._pending[len(self._pending) - keep :]
            break
        return "".join(content), calls

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """What is left when the answer ends: an open block whose body is a call is one (the answer was cut
        at its closing tag); else it is text, as a partial tag is."""
        if self._in_block:
            call = _call(self._pending)
            if call is not None:
                self._pending, self._in_block, self._space = "", False, ""
                return "", self._take(call)
        rest = self._text((OPEN if self._in_block else "") + self._pending)
        if not self._called:
            rest += self._space
        self._pending, self._in_block, self._space = "", False, ""
        return rest, []

    def _take(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        """``[call]``, or none past ``max_calls``."""
        if self._left is None:
            return [call]
        if self._left == 0:
            return []
        self._left -= 1
        return [call]

    def _text(self, text: str) -> str:
        """Text to send: trailing whitespace is held until text that is not whitespace follows (dropped at
        the end of an answer that made calls: the whitespace around blocks is no content, whichever way
        the deltas fell)."""
        text = self._space + text
        sent = text.rstrip()
        self._space = text[len(sent) :]
        return sent


def _partial_tag(text: str) -> int:
    """The length of the longest end of ``text`` that begins the opening tag."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0
