"""``<tool_call>`` blocks (JSON bodies as Qwen3's template asks, XML-like ones as Qwen3.5's) and
DeepSeek's special-token blocks (V3's fenced arguments, V3.1's bare ones) turned into OpenAI's
``tool_calls``: the parser on whole and streamed text, and the chat answer built from a model's
text (whole and streamed), since a tiny random model cannot be made to write a call through the real
server."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from chat_answers import ReplayedStream, engineless_serving, text_output
from server_harness import BOUNDED_TOOLS

from pegainfer.errors import RequestError
from pegainfer.sampling.structured import GrammarCompiler, StructuredOutputsParams
from pegainfer.server.forced_tools import forced_calls, forced_schema
from pegainfer.server.protocol import ChatCompletionRequest
from pegainfer.server.tool_calls import (
    DEEPSEEK,
    DEEPSEEK_DSML,
    QWEN,
    ToolCallStream,
    split_tool_calls,
    tool_call_format,
)
from pegainfer.text.tiny_tokenizer import CHAT_TEMPLATE, build_tiny_tokenizer
from pegainfer.text.tokenizer import Tokenizer

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}'
ANSWER = (
    f"Let me look.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n" + '{"name": "now"}\n</tool_call>'
)


def _names_and_arguments(calls: list[dict]) -> list[tuple[str, dict]]:
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


XML_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n<parameter=note>\nline one\nline two\n</parameter>\n"
    "</function>\n</tool_call>"
)


def test_whole_answer_splits_into_text_and_calls() -> None:
    content, calls = split_tool_calls(ANSWER, QWEN)
    assert content == "Let me look."
    assert _names_and_arguments(calls) == [("get_weather", {"city": "Paris", "unit": "C"}), ("now", {})]
    assert len({c["id"] for c in calls}) == 2


def test_xml_bodies_and_their_typed_values() -> None:
    content, calls = split_tool_calls("Checking." + XML_CALL, QWEN)
    assert content == "Checking."
    assert _names_and_arguments(calls) == [
        ("get_weather", {"city": "Paris", "days": 3, "note": "line one\nline two"})
    ]


def test_a_block_cut_before_its_closing_tag_is_still_a_call() -> None:
    """A ``</tool_call>`` stop string (or a length cut) ends the answer inside the block."""
    cut = '<tool_call>\n{"name": "f", "arguments": null}\n'
    assert _names_and_arguments(split_tool_calls(cut, QWEN)[1]) == [("f", {})]
    assert (
        _names_and_arguments(split_tool_calls(XML_CALL[: -len("</tool_call>")], QWEN)[1])[0][0]
        == "get_weather"
    )


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>\nnot json\n</tool_call>",  # neither form
        '<tool_call>["get_weather"]</tool_call>',  # not an object
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        'Almost: <tool_call>{"name": "f"',  # never closed, and no call
        "ends on half a tag <tool_",
        "spaces at the end stay  \n",
    ],
    ids=["not-a-call", "not-object", "no-name", "unclosed", "partial-tag", "trailing-space"],
)
def test_what_is_not_a_call_stays_text(text: str) -> None:
    assert split_tool_calls(text, QWEN) == (text, [])


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
@pytest.mark.parametrize(
    "answer", [ANSWER, "\n" + XML_CALL + "\n\n" + ANSWER + " and done. "], ids=["json", "mixed"]
)
def test_streamed_deltas_give_the_whole_answers_split(size: int, answer: str) -> None:
    stream, content, calls = ToolCallStream(QWEN), "", []
    for i in range(0, len(answer), size):
        text, made = stream.feed(answer[i : i + size])
        assert "<tool" not in text  # nothing of a block leaks out as text
        content, calls = content + text, calls + made
    rest, more = stream.finish()
    content, calls = content + rest, calls + more
    whole_content, whole_calls = split_tool_calls(answer, QWEN)
    assert content == whole_content
    assert _names_and_arguments(calls) == _names_and_arguments(whole_calls)


def test_calls_past_the_bound_are_dropped_whole_or_streamed() -> None:
    """``parallel_tool_calls: false``: the first call only, the others neither calls nor text."""
    stream, content, calls = ToolCallStream(QWEN, max_calls=1), "", []
    for i in range(0, len(ANSWER), 4):
        text, made = stream.feed(ANSWER[i : i + 4])
        content, calls = content + text, calls + made
    assert stream.finish() == ("", [])
    assert split_tool_calls(ANSWER, QWEN, max_calls=1)[0] == content == "Let me look."
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert [c["function"]["name"] for c in split_tool_calls(ANSWER, QWEN, max_calls=1)[1]] == ["get_weather"]


def test_the_templates_that_ask_for_tool_call_blocks() -> None:
    assert tool_call_format(CHAT_TEMPLATE) is QWEN
    assert tool_call_format("{% for m in messages %}{{ m.content }}{% endfor %}") is None


# ------------------------------------------------------------------------------ the chat answer


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def _body(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS, **fields}
    )


def test_answer_carries_tool_calls_and_their_finish_reason() -> None:
    serving, body = engineless_serving(), _body()
    tools = serving._tool_call_format(body)
    choice = serving._response(body, "chatcmpl-1", text_output(ANSWER), tools)["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me look."
    only_calls = serving._response(body, "c", text_output("\n" + XML_CALL + "\n"), tools)["choices"][0][
        "message"
    ]
    assert only_calls["content"] is None and len(only_calls["tool_calls"]) == 1
    one = serving._response(_body(parallel_tool_calls=False), "c", text_output(ANSWER), tools)["choices"][0]
    assert [c["function"]["name"] for c in one["message"]["tool_calls"]] == ["get_weather"]
    assert [name for name, _ in _names_and_arguments(choice["message"]["tool_calls"])] == [
        "get_weather",
        "now",
    ]
    # Cut by max_tokens the reason stays "length"; a refused tool_choice leaves the text alone.
    assert (
        serving._response(body, "c", text_output(ANSWER, "length"), tools)["choices"][0]["finish_reason"]
        == "length"
    )
    refused = _body(tool_choice="none")
    assert serving._tool_call_format(refused) is None and serving._tool_call_format(_body(tools=None)) is None
    plain = serving._response(refused, "c", text_output(ANSWER), None)["choices"][0]
    assert plain["message"] == {"role": "assistant", "content": ANSWER} and plain["finish_reason"] == "stop"


def test_streamed_answer_sends_calls_as_deltas() -> None:
    pieces = [ANSWER[i : i + 5] for i in range(0, len(ANSWER), 5)]
    outputs = [text_output(piece, "stop" if i == len(pieces) - 1 else None) for i, piece in enumerate(pieces)]
    serving = engineless_serving()

    async def events() -> list[dict]:
        return [
            json.loads(e[len("data: ") :])
            async for e in serving._events(_body(stream=True), "chatcmpl-1", ReplayedStream(outputs), QWEN, 2)
            if e.startswith("data: {")
        ]

    chunks = asyncio.run(events())
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0]["role"] == "assistant"
    assert "".join(d.get("content") or "" for d in deltas) == "Let me look."
    calls = [call for d in deltas for call in d.get("tool_calls", [])]
    assert [c["index"] for c in calls] == [0, 1]
    assert [name for name, _ in _names_and_arguments(calls)] == ["get_weather", "now"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


# ------------------------------------------------------------------------------ DeepSeek's form

V3_CALLS = (
    "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
    '{"city": "Paris"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>now\n```json\n{}\n```'
    "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
)
V31_CALLS = (
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
    '{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>now<｜tool▁sep｜>{}<｜tool▁call▁end｜>'
    "<｜tool▁calls▁end｜>"
)
# What DeepSeek-V3's template says of tools (a piece of it): the markers it wants back.
DEEPSEEK_TEMPLATE = (
    "{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>'}}"
)


@pytest.mark.parametrize("answer", [V3_CALLS, V31_CALLS], ids=["v3", "v3.1"])
@pytest.mark.parametrize("size", [1, 4, 1000])
def test_deepseek_calls_whole_and_streamed(answer: str, size: int) -> None:
    content, calls = split_tool_calls(answer, DEEPSEEK)
    assert content == answer[: answer.index("<｜")]
    assert _names_and_arguments(calls) == [("get_weather", {"city": "Paris"}), ("now", {})]
    stream, streamed, streamed_calls = ToolCallStream(DEEPSEEK), "", []
    for i in range(0, len(answer), size):
        text, made = stream.feed(answer[i : i + size])
        assert "<｜" not in text  # no marker leaks out, whole or in part
        streamed, streamed_calls = streamed + text, streamed_calls + made
    rest, more = stream.finish()
    assert streamed + rest == content
    assert _names_and_arguments(streamed_calls + more) == _names_and_arguments(calls)


@pytest.mark.parametrize(
    "body",
    [
        "function<｜tool▁sep｜>f\n{}",  # V3 without its fence
        "function<｜tool▁sep｜>f\n```json\nnot json\n```",
        "f<｜tool▁sep｜>[1, 2]",  # arguments not an object
        "<｜tool▁sep｜>{}",  # no name
        "f {}",  # no separator
    ],
)
def test_deepseek_bodies_that_are_no_call_stay_text(body: str) -> None:
    text = "<｜tool▁call▁begin｜>" + body + "<｜tool▁call▁end｜>"
    assert split_tool_calls(text, DEEPSEEK) == (text, [])


def test_deepseek_template_asks_for_special_token_calls() -> None:
    """Its markers are special tokens: the answer must be detokenized keeping them."""
    assert tool_call_format(DEEPSEEK_TEMPLATE) is DEEPSEEK and DEEPSEEK.special_tokens
    serving = engineless_serving()
    serving.tokenizer = SimpleNamespace(chat_template_source=lambda tools=None: DEEPSEEK_TEMPLATE)
    form = serving._tool_call_format(_body())
    choice = serving._response(_body(), "c", text_output(V31_CALLS), form)["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather", "now"]


def test_deepseek_tool_requests_keep_special_tokens_in_the_text() -> None:
    """Only a request whose calls would be parsed in DeepSeek's form changes skip_special_tokens."""
    from pegainfer import SamplingParams

    serving = engineless_serving()
    serving.tokenizer = SimpleNamespace(chat_template_source=lambda tools=None: DEEPSEEK_TEMPLATE)
    submitted = []

    async def submit(request_id, inputs, params):
        submitted.append(params.skip_special_tokens)
        return ReplayedStream([])

    async def collect(stream, raw):
        return {0: text_output("plain")}

    serving.check_request = lambda body: None
    serving.render_chat = lambda body: "prompt"
    serving.encode = lambda text, add_special_tokens: [1, 2]
    serving.sampling_params = lambda *args: SamplingParams()
    serving.new_id = lambda: "chatcmpl-1"
    serving.submit, serving.collect = submit, collect
    for body in (_body(), _body(tool_choice="none"), _body(tools=None)):
        asyncio.run(serving.create(body, raw=None))
    assert submitted == [False, True, True]


# ------------------------------------------------------------------------------ forced tool_choice


def test_forced_schemas_and_their_calls() -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    parameters = BOUNDED_TOOLS[0]["function"]["parameters"]
    assert forced_schema(BOUNDED_TOOLS, named, None) == {**parameters, "x-guidance": {"lenient": True}}
    required = forced_schema(BOUNDED_TOOLS, "required", False)
    assert required["minItems"] == required["maxItems"] == 1 and len(required["items"]["anyOf"]) == 2
    assert forced_schema(BOUNDED_TOOLS, "auto", None) is None and forced_schema(None, None, None) is None
    [call] = forced_calls('{"city": "Rome", "days": 2}', named)
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Rome", "days": 2}'}
    calls = forced_calls(
        '[{"name": "now", "parameters": {}}, {"name": "get_weather", "parameters": {"days": 1}}]', "required"
    )
    assert _names_and_arguments(calls) == [("now", {}), ("get_weather", {"days": 1})]
    assert forced_calls('[{"name": "now", "par', "required") is None  # cut: no calls
    assert forced_calls('"now"', "required") is None and forced_calls("[1]", "required") is None


@pytest.mark.parametrize(
    "tools, choice",
    [
        (BOUNDED_TOOLS, {"type": "function", "function": {"name": "missing"}}),
        (BOUNDED_TOOLS, {"type": "function"}),
        (BOUNDED_TOOLS, "always"),
        (None, "required"),
    ],
)
def test_forced_choices_that_cannot_be_honoured_are_refused(tools, choice) -> None:
    with pytest.raises(RequestError) as error:
        forced_schema(tools, choice, None)
    assert error.value.param == "tool_choice"


def test_required_calls_keep_each_tools_own_refs() -> None:
    """A tool's parameters moved into the list's schema keep their meaning: "#/$defs/X" and a recursive
    "#" point into the tool's own schema, so the grammar accepts the tool's valid arguments and refuses
    what only a misread ref would allow."""
    tree = {
        "type": "object",
        "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}, "tag": {"$ref": "#/$defs/Tag"}},
        "required": ["kids"],
        "additionalProperties": False,
        "$defs": {"Tag": {"enum": ["a", "b"]}},
    }
    tools = [{"type": "function", "function": {"name": "tree", "parameters": tree}}]
    tokenizer = Tokenizer(build_tiny_tokenizer())
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size)

    def accepts(text: str) -> bool:
        matcher = compiler.matcher(StructuredOutputsParams(json=forced_schema(tools, "required", None)))
        return matcher.try_consume_tokens(tokenizer.encode(text, add_special_tokens=False)) == len(
            tokenizer.encode(text, add_special_tokens=False)
        )

    assert accepts('[{"name":"tree","parameters":{"kids":[{"kids":[],"tag":"b"}],"tag":"a"}}]')
    assert not accepts('[{"name":"tree","parameters":{"kids":[[{"name":"tree"')
    assert not accepts('[{"name":"tree","parameters":{"kids":[],"tag":"c"')


DSML_CALLS = (
    'Checking.\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
    '<｜DSML｜invoke name="now">\n</｜DSML｜invoke>\n</｜DSML｜function_calls>'
)


@pytest.mark.parametrize("size", [1, 5, 1000])
def test_deepseek_v32_dsml_calls_whole_and_streamed(size: int) -> None:
    """V3.2's DSML form: string="true" values stay strings, string="false" ones are JSON."""
    assert tool_call_format('{{ "<｜DSML｜invoke name=\\"" + tool.name }}') is DEEPSEEK_DSML
    content, calls = split_tool_calls(DSML_CALLS, DEEPSEEK_DSML)
    assert content == "Checking."
    assert _names_and_arguments(calls) == [("get_weather", {"city": "Paris", "days": 3}), ("now", {})]
    stream, streamed, streamed_calls = ToolCallStream(DEEPSEEK_DSML), "", []
    for i in range(0, len(DSML_CALLS), size):
        text, made = stream.feed(DSML_CALLS[i : i + size])
        assert "<｜" not in text
        streamed, streamed_calls = streamed + text, streamed_calls + made
    rest, more = stream.finish()
    assert streamed + rest == content
    assert _names_and_arguments(streamed_calls + more) == _names_and_arguments(calls)
    bad = '<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="n" string="false">not json</｜DSML｜parameter>\n</｜DSML｜invoke>'
    assert split_tool_calls(bad, DEEPSEEK_DSML) == (bad, [])
