"""``server.reasoning_parser``: a thinking model's ``<think>`` block returned apart as
``reasoning_content`` / ``reasoning``, whole and streamed, where the prompt or the answer opens it."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from chat_answers import ReplayedStream, engineless_serving, text_output
from server_harness import ServerHandle, start_server

from pegainfer.server.config import ServerConfig
from pegainfer.server.protocol import ChatCompletionRequest
from pegainfer.server.reasoning import ReasoningStream, opens_thinking, split_reasoning
from pegainfer.server.tool_calls import QWEN

QWEN35_PROMPT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n"
THINKING_OFF_PROMPT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
HISTORY_PROMPT = "<|im_start|>assistant\n<think>\nold\n</think>\n\nyes<|im_end|>\n<|im_start|>assistant\n"


ASKING_PROMPT = "<|im_start|>system\nReason inside <think> tags.<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize(
    ("prompt", "opens"),
    [(QWEN35_PROMPT, True), (THINKING_OFF_PROMPT, False), (HISTORY_PROMPT, False), ("plain", False),
     (HISTORY_PROMPT + "<think>\n", True), (ASKING_PROMPT, False), ("<｜Assistant｜><think>", True)],
)  # fmt: skip
def test_the_prompt_says_whether_the_answer_starts_thinking(prompt: str, opens: bool) -> None:
    """Only the generation prompt's own opening tag counts, not a ``<think>`` in a message."""
    assert opens_thinking(prompt) is opens


def test_a_continued_message_says_it_itself() -> None:
    assert opens_thinking(ASKING_PROMPT + "<think>\nWell", "<think>\nWell")
    assert not opens_thinking(ASKING_PROMPT + "<think>x</think>So", "<think>x</think>So")
    assert not opens_thinking(QWEN35_PROMPT, "")  # the continued message is empty: nothing open in it


@pytest.mark.parametrize(
    ("text", "thinking", "split"),
    [
        ("Let me see.</think>\n\nParis.", True, ("Let me see.", "\n\nParis.")),  # Qwen3.5, R1: opened
        ("<think>\nhmm\n</think>\n\nParis.", False, ("\nhmm\n", "\n\nParis.")),  # Qwen3: the answer opens
        ("Paris.", False, (None, "Paris.")),  # thinking off, or a model that does not think
        ("still thinking", True, ("still thinking", None)),  # cut by max_tokens inside the block
        ("</think>Paris.", True, (None, "Paris.")),  # empty parts are absent, as when streamed
        ("done</think>", True, ("done", None)),
        ("<think>again</think>x", True, ("again", "x")),  # the tag repeated after the prompt's own
        (" <think>x</think>", False, (None, " <think>x</think>")),  # only an opening tag opens
    ],
)
def test_whole_answers_split_at_the_closing_tag(text: str, thinking: bool, split: tuple) -> None:
    assert split_reasoning(text, thinking) == split


ANSWERS = [
    ("Let me see.</think>\n\nParis.", True),
    ("<think>\nhmm <thin </thi\n</think>\n\nParis </think> again.", False),
    ("<thin", False),
    ("<think>cut in the tag </thi", False),
    ("no tags at all <think>", False),
    ("</think>", True),
    ("", True),
    ("<think>again</think>x", True),
    ("<thin", True),
]


@pytest.mark.parametrize(("text", "thinking"), ANSWERS)
def test_streamed_pieces_give_the_whole_split(text: str, thinking: bool) -> None:
    rng = random.Random(len(text))
    for trial in range(40):
        cuts = sorted(rng.sample(range(1, len(text)), min(trial % 6, max(len(text) - 1, 0)))) if text else []
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        if trial == 0:
            pieces = list(text)  # one character a piece: every tag arrives cut
        stream = ReasoningStream(thinking)
        fed = [stream.feed(piece) for piece in pieces] + [stream.finish()]
        reasoning, content = split_reasoning(text, thinking)
        assert "".join(r for r, _ in fed) == (reasoning or ""), pieces
        assert "".join(c for _, c in fed) == (content or ""), pieces


# ------------------------------------------------------------------------------ the chat answer


def _body(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


CALL = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'


def test_the_message_carries_reasoning_and_content_and_calls_after_it() -> None:
    serving = engineless_serving(reasoning=True)
    message = serving._response(_body(), "c", text_output("Hmm.</think>\n\nHi."), None, thinking=True)
    assert message["choices"][0]["message"] == {
        "role": "assistant",
        "content": "\n\nHi.",
        "reasoning_content": "Hmm.",
        "reasoning": "Hmm.",
    }
    left_out = serving._response(
        _body(include_reasoning=False), "c", text_output("Hmm.</think>Hi."), None, thinking=True
    )
    assert left_out["choices"][0]["message"] == {"role": "assistant", "content": "Hi."}
    cut = serving._response(_body(), "c", text_output("Hmm, and", "length"), None, thinking=True)["choices"][
        0
    ]
    assert cut["message"]["content"] is None and cut["message"]["reasoning"] == "Hmm, and"
    # A call written in the reasoning is not a call; one after it is.
    tools = [{"type": "function", "function": {"name": "now"}}]
    answer = text_output(f"maybe {CALL}</think>{CALL}")
    choice = serving._response(_body(tools=tools), "c", answer, QWEN, thinking=True)["choices"][0]
    assert choice["message"]["reasoning"] == f"maybe {CALL}"
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["now"]
    assert choice["finish_reason"] == "tool_calls"


def _deltas(body: ChatCompletionRequest, text: str, thinking: bool) -> list[dict]:
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]
    outputs = [text_output(p, "stop" if i == len(pieces) - 1 else None) for i, p in enumerate(pieces)]

    async def events() -> list[dict]:
        return [
            json.loads(e[len("data: ") :])["choices"][0]["delta"]
            async for e in engineless_serving(reasoning=True)._events(
                body, "c", ReplayedStream(outputs), None, 2, thinking
            )
            if e.startswith("data: {")
        ]

    return asyncio.run(events())


def test_streamed_deltas_carry_reasoning_then_content() -> None:
    deltas = _deltas(_body(stream=True), "<think>\nHmm, </thi and more\n</think>\n\nHi there.", False)
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "\nHmm, </thi and more\n"
    assert "".join(d.get("reasoning", "") for d in deltas) == "\nHmm, </thi and more\n"
    assert "".join(d.get("content") or "" for d in deltas) == "\n\nHi there."
    last_reasoning = max(i for i, d in enumerate(deltas) if d.get("reasoning"))
    assert all(not d.get("content") for d in deltas[1:last_reasoning])  # content only after the reasoning
    off = _deltas(_body(stream=True, include_reasoning=False), "Hmm.</think>Hi.", True)
    assert all("reasoning" not in d for d in off) and "".join(d.get("content") or "" for d in off) == "Hi."


# ------------------------------------------------------------------------------ through the server


@pytest.fixture(scope="module")
def thinking_server(tiny_qwen3: Path) -> Iterator[ServerHandle]:
    handle = start_server(tiny_qwen3, reasoning_parser="qwen3")
    yield handle
    handle.stop()


def test_the_server_splits_what_the_plain_server_returns_whole(
    thinking_server: ServerHandle, http: httpx.Client
) -> None:
    """The same greedy answer from a server without the parser and one with it: the prompt opened by the
    assistant's own ``<think>`` (continue_final_message) makes all of it reasoning; otherwise content."""
    opened = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<think>\nWell"}]
    cases = [
        ({"messages": opened, "continue_final_message": True, "add_generation_prompt": False}, True),
        ({"messages": [{"role": "user", "content": "hi"}]}, False),
    ]
    with thinking_server.client() as split_http:
        for fields, thinking in cases:
            body = {**fields, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
            whole = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
            split = split_http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
            reasoning, content = split_reasoning(whole["content"], thinking)
            assert (split.get("reasoning_content"), split["content"]) == (reasoning, content)
            if thinking:
                assert split["reasoning"] == reasoning is not None
            streamed = split_http.post("/v1/chat/completions", json={**body, "stream": True})
            deltas = [
                json.loads(line[len("data: ") :])["choices"][0]["delta"]
                for line in streamed.text.splitlines()
                if line.startswith("data: {")
            ]
            assert "".join(d.get("reasoning") or "" for d in deltas) == (reasoning or "")
            assert "".join(d.get("content") or "" for d in deltas) == (content or "")


def test_an_unknown_parser_is_refused_naming_the_key() -> None:
    with pytest.raises(ValueError, match="reasoning_parser"):
        ServerConfig(reasoning_parser="o1")


def _think_end(server: ServerHandle) -> int:
    [token] = server.call(lambda engine: engine.tokenizer.encode("</think>", add_special_tokens=False))
    return token


def test_a_grammar_starts_after_the_reasoning(thinking_server: ServerHandle) -> None:
    """With the block opened by the prompt, ``response_format`` and a forced tool constrain only what
    follows ``</think>``: the reasoning is free text, the content (or the call's arguments) valid JSON.
    A bias on ``</think>`` makes the random model close the block within a few tokens."""
    opened = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<think>\nWell"}]
    # Bounded shapes: a random model's free strings would run past max_tokens.
    digit = {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"], "additionalProperties": False,
    }  # fmt: skip
    tools = [{"type": "function", "function": {"name": "now", "parameters": digit}}]
    schema = {"type": "json_schema", "json_schema": {"name": "digit", "schema": digit}}
    base = {
        "messages": opened, "continue_final_message": True, "add_generation_prompt": False,
        "max_tokens": 60, "temperature": 0.0, "logit_bias": {str(_think_end(thinking_server)): 9.0},
    }  # fmt: skip
    with thinking_server.client() as http:
        answer = http.post("/v1/chat/completions", json={**base, "response_format": schema})
        message = answer.json()["choices"][0]["message"]
        assert set(json.loads(message["content"])) == {"n"}, message
        assert message.get("reasoning"), "the random model wrote no reasoning before the bias closed it"
        forced = {**base, "tools": tools, "tool_choice": {"type": "function", "function": {"name": "now"}}}
        call = http.post("/v1/chat/completions", json=forced).json()["choices"][0]["message"]
        assert call.get("reasoning") and call["content"] is None, call
        assert set(json.loads(call["tool_calls"][0]["function"]["arguments"])) == {"n"}, call
        streamed = http.post("/v1/chat/completions", json={**forced, "stream": True})
        deltas = [
            json.loads(line[len("data: ") :])["choices"][0]["delta"]
            for line in streamed.text.splitlines()
            if line.startswith("data: {")
        ]
        assert "".join(d.get("reasoning") or "" for d in deltas) == call["reasoning"]
        pieces = [c for d in deltas for c in d.get("tool_calls", [])]
        assert pieces[0]["function"]["name"] == "now"
        assert (
            "".join(c["function"].get("arguments", "") for c in pieces)
            == call["tool_calls"][0]["function"]["arguments"]
        )
        opened_at = next(i for i, d in enumerate(deltas) if d.get("tool_calls"))
        assert not any(d.get("reasoning") for d in deltas[opened_at:])  # the call opens after the reasoning


def test_a_forced_call_cut_inside_the_reasoning_makes_no_call(thinking_server: ServerHandle) -> None:
    """An answer that ends before ``</think>`` (EOS, here pushed; or max_tokens) has reasoning only: no
    named call with empty arguments, no list, whole or streamed."""
    eos = thinking_server.call(lambda engine: engine.tokenizer.eos_token_id)
    opened = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<think>\nWell"}]
    tools = [{"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}]
    named = {"type": "function", "function": {"name": "now"}}
    with thinking_server.client() as http:
        for choice, bias in ((named, {str(eos): 30}), ("required", {str(eos): 30}), (named, {})):
            body = {
                "messages": opened, "continue_final_message": True, "add_generation_prompt": False,
                "tools": tools, "tool_choice": choice, "temperature": 0.0, "max_tokens": 6,
                "logit_bias": {**bias, str(_think_end(thinking_server)): -100},
            }  # fmt: skip
            message = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
            assert message["content"] is None and "tool_calls" not in message, message
            assert message.get("reasoning") or bias, message  # EOS at once may leave no reasoning at all
            streamed = http.post("/v1/chat/completions", json={**body, "stream": True}).text
            assert '"tool_calls"' not in streamed


@pytest.mark.parametrize("special", [True, False])
def test_special_think_tags_are_kept_in_the_text_the_split_reads(special: bool) -> None:
    from pegainfer import SamplingParams

    serving = engineless_serving(reasoning=True)
    serving.tokenizer = SimpleNamespace(
        encode=lambda text, add_special_tokens=True: [9],
        decode=lambda ids, skip_special_tokens=True: "" if special and skip_special_tokens else "</think>",
    )
    params = SamplingParams()
    assert serving._thinking(_body(), QWEN35_PROMPT, params) is True
    assert params.skip_special_tokens is not special
