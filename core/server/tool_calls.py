"""Tool calls in generated text, in the forms the supported models' chat templates teach:

- ``<tool_call>...</tool_call>`` blocks (the Qwen templates), with either body: a JSON object
  ``{"name": ..., "arguments": {...}}`` (the Hermes form: Qwen2.5, Qwen3) or XML-like tags
  ``<function=NAME><parameter=KEY>value</parameter>...</function>`` (Qwen3.5, Qwen3-Coder);
- DeepSeek's special-token blocks ``<｜tool▁call▁begin｜>...<｜tool▁call▁end｜>`` inside
  ``<｜tool▁calls▁begin｜>...<｜tool▁calls▁end｜>``: ``function<｜tool▁sep｜>NAME`` then the arguments in a
  json code fence (DeepSeek-V3, R1), or ``NAME<｜tool▁sep｜>ARGUMENTS`` (V3.1). Its markers are special
  tokens, so such answers are detokenized keeping them (:attr:`ToolCallFormat.special_tokens`);
- DeepSeek-V3.2's DSML blocks ``<｜DSML｜invoke name="NAME">`` with ``<｜DSML｜parameter name="KEY"
  string="true|false">`` pieces inside ``<｜DSML｜function_calls>``, kept the same way.

A chat request with ``tools`` (and ``tool_choice`` not "none") to a model whose template speaks one of
these (:func:`tool_call_format`) gets OpenAI's ``tool_calls`` in place of the blocks:
:func:`split_tool_calls` for a whole answer, :class:`ToolCallStream` for a streamed one, where text that
may still turn into a block is held back until it is known, and so is trailing whitespace (an answer
with calls drops what no text follows, whole or streamed alike). A block left open when the answer ends
(a closing-tag stop string, a length cut) is a call if its body is one. A body that is not a call stays
text, as the model wrote it: a malformed call is the client's to see, not to lose.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pegainfer.server.streaming import partial_marker


@dataclass(frozen=True)
class ToolCallFormat:
    """How one family of templates marks a call: ``open``/``close`` around each call's body, which
    ``parse`` reads as (name, arguments) or None (not a call); ``dropped``: markers around groups of
    calls, no part of the content; ``special_tokens``: the markers are special tokens, which the
    answer's text must keep (``skip_special_tokens=False``) for the calls to be found."""

    open: str
    close: str
    parse: Callable[[str], tuple[str, Any] | None]
    dropped: tuple[str, ...] = ()
    special_tokens: bool = False

    @property
    def markers(self) -> tuple[str, ...]:
        """What a streamed answer holds back while it may still be forming."""
        return (self.open, *self.dropped)


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


def _qwen_body(body: str) -> tuple[str, Any] | None:
    return _json_body(body.strip()) or _xml_body(body)


_DEEPSEEK_SEP = "<｜tool▁sep｜>"
_DEEPSEEK_FENCED = re.compile(r"\s*([^\n]+?)\s*\n```(?:json)?[ \t]*\n(.*?)\s*```\s*", re.DOTALL)


def _deepseek_body(body: str) -> tuple[str, Any] | None:
    """``function<｜tool▁sep｜>NAME`` and a json fence (V3, R1), or ``NAME<｜tool▁sep｜>JSON`` (V3.1);
    the arguments must be a JSON object."""
    kind, sep, rest = body.partition(_DEEPSEEK_SEP)
    if not sep:
        return None
    if kind.strip() == "function":
        fenced = _DEEPSEEK_FENCED.fullmatch(rest)
        if fenced is None:
            return None
        name, arguments = fenced.group(1), fenced.group(2)
    else:
        name, arguments = kind.strip(), rest
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return None
    if not name or not isinstance(parsed, dict):
        return None
    return name, parsed


_DSML_INVOKE = re.compile(r'\s*name="([^"]+)"\s*>(.*)', re.DOTALL)
_DSML_PARAMETER = re.compile(
    r'<｜DSML｜parameter name="([^"]+)" string="(true|false)">(.*?)</｜DSML｜parameter>', re.DOTALL
)


def _dsml_body(body: str) -> tuple[str, Any] | None:
    """``name="NAME">`` then ``<｜DSML｜parameter name="KEY" string="true|false">value</...>`` pieces
    (DeepSeek-V3.2): a ``string="false"`` value is JSON, the others strings; nothing else but blanks."""
    invoke = _DSML_INVOKE.fullmatch(body)
    if invoke is None or _DSML_PARAMETER.sub("", invoke.group(2)).strip():
        return None
    arguments: dict[str, Any] = {}
    for key, is_string, value in _DSML_PARAMETER.findall(invoke.group(2)):
        if is_string == "true":
            arguments[key] = value
            continue
        try:
            arguments[key] = json.loads(value)
        except ValueError:
            return None
    return invoke.group(1), arguments


QWEN = ToolCallFormat("<tool_call>", "</tool_call>", _qwen_body)
DEEPSEEK = ToolCallFormat(
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    _deepseek_body,
    dropped=("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"),
    special_tokens=True,
)
DEEPSEEK_DSML = ToolCallFormat(
    "<｜DSML｜invoke ",
    "</｜DSML｜invoke>",
    _dsml_body,
    dropped=("<｜DSML｜function_calls>", "</｜DSML｜function_calls>"),
    special_tokens=True,
)


def tool_call_format(template_source: str) -> ToolCallFormat | None:
    """The form a chat template asks tool calls in (it names the markers it wants back), or None."""
    for form in (QWEN, DEEPSEEK, DEEPSEEK_DSML):
        if form.open in template_source:
            return form
    return None


def _call(body: str, form: ToolCallFormat) -> dict[str, Any] | None:
    """OpenAI's tool call for a block's body, or None when it is not a call."""
    parsed = form.parse(body)
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


def split_tool_calls(
    text: str, form: ToolCallFormat, max_calls: int | None = None
) -> tuple[str, list[dict[str, Any]]]:
    """(the text outside the tool-call blocks, the calls in order) of a whole answer."""
    stream = ToolCallStream(form, max_calls)
    content, calls = stream.feed(text)
    rest, more = stream.finish()
    return content + rest, calls + more


class ToolCallStream:
    """Streamed text in, (content delta, completed calls) out, for the blocks of ``form``: a block's text
    is held until its closing marker; text that could be the start of a marker waits for the next delta, and trailing whitespace
    for text that is not whitespace. ``max_calls`` (``parallel_tool_calls: false`` asks for one): calls past
    it are dropped."""

    def __init__(self, form: ToolCallFormat, max_calls: int | None = None) -> None:
        self._form = form
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
            form = self._form
            if self._in_block:
                end = self._pending.find(form.close)
                if end < 0:
                    break
                body = self._pending[:end]
                call = _call(body, form)
                if call is None:
                    content.append(self._text(form.open + body + form.close))
                else:
                    calls += self._take(call)
                    self._called = True
                self._pending = self._pending[end + len(form.close) :]
                self._in_block = False
                continue
            for marker in form.dropped:
                self._pending = self._pending.replace(marker, "")
            start = self._pending.find(form.open)
            if start >= 0:
                content.append(self._text(self._pending[:start]))
                self._pending = self._pending[start + len(form.open) :]
                self._in_block = True
                continue
            keep = partial_marker(self._pending, form.markers)
            content.append(self._text(self._pending[: len(self._pending) - keep]))
            self._pending = self._pending[len(self._pending) - keep :]
            break
        return "".join(content), calls

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """What is left when the answer ends: an open block whose body is a call is one (the answer was cut
        at its closing tag); else it is text, as a partial tag is."""
        if self._in_block:
            call = _call(self._pending, self._form)
            if call is not None:
                self._pending, self._in_block, self._space = "", False, ""
                return "", self._take(call)
        rest = self._text((self._form.open if self._in_block else "") + self._pending)
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
