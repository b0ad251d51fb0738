"""The official `openai` client against the real server: completions and chat, streaming and not, n > 1,
logprobs, stop strings, seeds, token-id prompts, usage chunks."""

from __future__ import annotations

import json

import openai
import pytest
from server_harness import API_KEY, BOUNDED_TOOLS, ServerHandle

PROMPT_IDS = [11, 42, 7, 300, 5, 99, 120]
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def client(server: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_models_lists_the_served_model(client: openai.OpenAI, server: ServerHandle) -> None:
    models = client.models.list().data
    assert len(models) == 1 and models[0].object == "model" and models[0].owned_by == "pegainfer"


def test_completion_greedy_matches_offline_engine(
    client: openai.OpenAI, model: str, server: ServerHandle
) -> None:
    out = client.completions.create(model=model, prompt=PROMPT_IDS, max_tokens=12, **GREEDY)
    choice = out.choices[0]
    assert choice.finish_reason == "length" and out.object == "text_completion"
    assert out.usage.prompt_tokens == len(PROMPT_IDS) and out.usage.completion_tokens == 12
    again = client.completions.create(model=model, prompt=PROMPT_IDS, max_tokens=12, **GREEDY)
    assert again.choices[0].text == choice.text
    # The same text streamed, chunk by chunk.
    stream = client.completions.create(model=model, prompt=PROMPT_IDS, max_tokens=12, stream=True, **GREEDY)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_continuous_usage_stats_count_the_tokens_so_far(client: openai.OpenAI, model: str, api: str) -> None:
    """``stream_options.continuous_usage_stats`` (vLLM's): every content chunk carries the usage so far,
    the completion tokens growing to the final usage chunk's."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    if api == "completions":
        stream = client.completions.create(
            model=model, prompt=PROMPT_IDS, max_tokens=6, stream=True, stream_options=options, **GREEDY
        )
    else:
        messages = [{"role": "user", "content": "Hi there!"}]
        stream = client.chat.completions.create(
            model=model, messages=messages, max_tokens=6, stream=True, stream_options=options, **GREEDY
        )
    chunks = list(stream)
    final = chunks[-1].usage
    assert chunks[-1].choices == [] and final.completion_tokens == 6
    if api == "chat":  # the role chunk, before any token: the prompt alone
        role = chunks[0]
        assert role.choices[0].delta.role == "assistant" and role.usage.completion_tokens == 0
        assert role.usage.prompt_tokens == final.prompt_tokens
        chunks = chunks[1:]
    content = [c for c in chunks[:-1] if c.usage is not None]
    assert content and all(c.choices for c in content)
    counts = [c.usage.completion_tokens for c in content]
    assert counts == sorted(counts) and counts[-1] == 6 and counts[0] >= 1
    assert {c.usage.prompt_tokens for c in content} == {final.prompt_tokens}
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in content)


def test_completion_text_prompt_list_and_n(client: openai.OpenAI, model: str) -> None:
    out = client.completions.create(
        model=model, prompt=["Hello there", "The lighthouse"], n=2, max_tokens=5, temperature=1.0, seed=3
    )
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert all(c.finish_reason in ("stop", "length") for c in out.choices)
    # Token-id lists count as several prompts too.
    out = client.completions.create(model=model, prompt=[PROMPT_IDS, PROMPT_IDS[:3]], max_tokens=3, **GREEDY)
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.prompt_tokens == len(PROMPT_IDS) + 3


def test_streamed_n_and_several_prompts_finish_every_choice(client: openai.OpenAI, model: str) -> None:
    stream = client.completions.create(
        model=model,
        prompt=["one", "two"],
        n=3,
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    finished: dict[int, str] = {}
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
            assert chunk.choices == []
        for c in chunk.choices:
            assert c.index not in finished, "a choice got text after its finish_reason"
            if c.finish_reason:
                finished[c.index] = c.finish_reason
    assert sorted(finished) == list(range(6)) and set(finished.values()) == {"length"}
    assert usage is not None and usage.completion_tokens == 36


def test_seed_makes_sampling_reproducible(client: openai.OpenAI, model: str) -> None:
    def run(seed: int) -> list[str]:
        out = client.completions.create(
            model=model, prompt=PROMPT_IDS, n=3, max_tokens=10, temperature=1.0, seed=seed
        )
        return [c.text for c in sorted(out.choices, key=lambda c: c.index)]

    first = run(7)
    assert run(7) == first
    assert len(set(first)) > 1 or run(8) != first


def test_completion_logprobs(client: openai.OpenAI, model: str) -> None:
    out = client.completions.create(model=model, prompt=PROMPT_IDS, max_tokens=6, logprobs=3, **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0.0 and 3 <= len(top) <= 4
        # Greedy: the chosen token is the most likely one.
        assert logprob == pytest.approx(max(top.values()))
        assert top[token] == pytest.approx(logprob)
    assert lp.text_offset[0] == 0


def test_chat_completion_and_stream(client: openai.OpenAI, model: str) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"}]
    out = client.chat.completions.create(model=model, messages=messages, max_tokens=8, **GREEDY)
    assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 8
    text = out.choices[0].message.content

    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    chunks = list(stream)
    first = chunks[0].choices[0]
    assert first.delta.role == "assistant" and not first.delta.content and first.finish_reason is None
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == out.usage.total_tokens


def test_chat_n_logprobs_and_max_completion_tokens(client: openai.OpenAI, model: str) -> None:
    out = client.chat.completions.create(
        model=model,
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": "Tell me"}, {"type": "text", "text": " more"}],
            }
        ],
        n=2,
        max_completion_tokens=4,
        logprobs=True,
        top_logprobs=2,
        temperature=1.0,
        seed=1,
    )
    assert [c.index for c in out.choices] == [0, 1]
    for choice in out.choices:
        content = choice.logprobs.content
        assert len(content) == 4
        assert all(len(item.top_logprobs) == 2 and item.logprob <= 0 for item in content)
        if "\ufffd" not in choice.message.content:  # byte tokens decode alone as U+FFFD
            assert "".join(item.token for item in content) == choice.message.content


def test_logit_bias_picks_and_bans_tokens(client: openai.OpenAI, model: str, server: ServerHandle) -> None:
    """OpenAI's logit_bias, token ids as keys: +100 makes greedy decoding repeat the token, -100 keeps
    the greedy answer's first token out of it; the logprobs stay the model's."""
    plain = client.completions.create(model=model, prompt=PROMPT_IDS, max_tokens=4, logprobs=1, **GREEDY)
    first = plain.choices[0].logprobs.tokens[0]
    forced = client.completions.create(
        model=model, prompt=PROMPT_IDS, max_tokens=4, logit_bias={"300": 100}, **GREEDY
    )
    assert forced.choices[0].text == server.call(lambda engine: engine.tokenizer.decode([300] * 4))

    def ids_shown_as(engine):  # the ids whose logprobs entry reads as the greedy answer's first token
        decode = engine.tokenizer.decode
        return [
            i
            for i in range(engine.executor.info.vocab_size)
            if decode([i], skip_special_tokens=False) == first
        ]

    bias = {str(i): -100 for i in server.call(ids_shown_as)}
    banned = client.completions.create(
        model=model, prompt=PROMPT_IDS, max_tokens=4, logprobs=1, logit_bias=bias, **GREEDY
    )
    assert bias and banned.choices[0].logprobs.tokens[0] != first


def test_allowed_token_ids_limit_the_answer(client: openai.OpenAI, model: str, server: ServerHandle) -> None:
    """vLLM's allowed_token_ids: every generated token is one of the list (the labels of a classifier)."""
    labels = [300, 301, 302]
    out = client.completions.create(
        model=model, prompt=PROMPT_IDS, max_tokens=6, logprobs=1, temperature=1.0, seed=3,
        extra_body={"allowed_token_ids": labels},
    )  # fmt: skip
    words = server.call(lambda engine: {engine.tokenizer.decode([i]) for i in labels})
    assert len(words) == 3 and set(out.choices[0].logprobs.tokens) <= words


def test_structured_outputs_through_response_format_and_the_vllm_extra(
    client: openai.OpenAI, model: str
) -> None:
    """response_format json_schema / json_object on chat, vLLM's structured_outputs (here a choice) on
    completions; a schema that does not compile is a 400 naming structured_outputs."""
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["n"],
        "additionalProperties": False,
    }
    answer = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "a number"}], max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "number", "schema": schema}},
    )  # fmt: skip
    assert type(json.loads(answer.choices[0].message.content)["n"]) is int
    assert answer.choices[0].finish_reason == "stop"
    anything = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "json"}], max_tokens=40, temperature=0,
        response_format={"type": "json_object"},
    )  # fmt: skip
    # A random model may stay inside a string until max_tokens: a cut answer is an object's beginning.
    content = anything.choices[0].message.content
    assert content.startswith("{") and (anything.choices[0].finish_reason == "length" or json.loads(content))
    picked = client.completions.create(
        model=model, prompt=PROMPT_IDS, max_tokens=8, temperature=1.0, seed=4,
        extra_body={"structured_outputs": {"choice": ["north", "south"]}},
    )  # fmt: skip
    assert picked.choices[0].text in ("north", "south")
    # The same grammars through completions' response_format and vLLM's older guided_* fields.
    older = client.completions.create(
        model=model, prompt=PROMPT_IDS, max_tokens=8, temperature=1.0, seed=4,
        extra_body={"guided_choice": ["north", "south"]},
    )  # fmt: skip
    assert older.choices[0].text in ("north", "south")
    as_json = client.completions.create(
        model=model, prompt=PROMPT_IDS, max_tokens=40, temperature=0,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}},
    )  # fmt: skip
    assert type(json.loads(as_json.choices[0].text)["n"]) is int
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(
            model=model, prompt=PROMPT_IDS, max_tokens=8, extra_body={"structured_outputs": {"regex": "("}}
        )
    assert error.value.body["param"] == "structured_outputs"


def test_forced_tool_choice_answers_with_calls(client: openai.OpenAI, model: str) -> None:
    """tool_choice naming a function or "required": the answer is made under the calls' JSON schema, so
    even the tiny random model answers with calls; streamed, a named call's id and name come first, then
    its arguments in pieces."""
    messages = [{"role": "user", "content": "weather?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    answer = client.chat.completions.create(
        model=model, messages=messages, tools=BOUNDED_TOOLS, tool_choice=named, max_tokens=40, temperature=0
    )
    choice = answer.choices[0]
    assert choice.message.content is None and choice.finish_reason == "stop"
    [call] = choice.message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and arguments["city"] in ("Paris", "Rome")
    assert 1 <= arguments["days"] <= 7
    required = client.chat.completions.create(
        model=model, messages=messages, tools=BOUNDED_TOOLS, tool_choice="required", max_tokens=80, temperature=0.8,
        seed=3, parallel_tool_calls=False,
    )  # fmt: skip
    assert required.choices[0].finish_reason == "tool_calls"
    assert [c.function.name in ("get_weather", "now") for c in required.choices[0].message.tool_calls] == [
        True
    ]
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        tools=BOUNDED_TOOLS,
        tool_choice=named,
        max_tokens=40,
        temperature=0,
        stream=True,
    )
    chunks = [chunk.choices[0] for chunk in stream if chunk.choices]
    streamed = [c for chunk in chunks for c in chunk.delta.tool_calls or []]
    assert not any(chunk.delta.content for chunk in chunks) and chunks[-1].finish_reason == "stop"
    # As OpenAI streams a call: its id and name first, then the arguments in pieces.
    assert streamed[0].id and streamed[0].function.name == "get_weather" and len(streamed) > 2
    assert all(c.index == 0 and c.id is None for c in streamed[1:])
    assert "".join(c.function.arguments or "" for c in streamed) == call.function.arguments


def test_stop_strings_cut_the_text(client: openai.OpenAI, model: str) -> None:
    ref = client.completions.create(model=model, prompt=PROMPT_IDS, max_tokens=20, **GREEDY).choices[0].text
    stop = next(
        ref[i : i + 2]
        for i in range(3, len(ref) - 2)
        if ref[i : i + 2].strip() and "\ufffd" not in ref[i : i + 2]
    )
    out = client.completions.create(model=model, prompt=PROMPT_IDS, max_tokens=20, stop=[stop], **GREEDY)
    assert out.choices[0].finish_reason == "stop" and out.choices[0].text == ref[: ref.index(stop)]
    streamed = client.completions.create(
        model=model, prompt=PROMPT_IDS, max_tokens=20, stop=stop, stream=True, **GREEDY
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == ref[: ref.index(stop)]


def test_extra_body_vllm_fields(client: openai.OpenAI, model: str) -> None:
    ref = client.completions.create(model=model, prompt=PROMPT_IDS, max_tokens=10, **GREEDY)
    out = client.completions.create(
        model=model,
        prompt=PROMPT_IDS,
        max_tokens=10,
        temperature=0.0,
        extra_body={
            "top_k": 5,
            "min_p": 0.01,
            "repetition_penalty": 1.0,
            "min_tokens": 2,
            "ignore_eos": True,
        },
    )
    assert out.choices[0].text == ref.choices[0].text
    echo = client.completions.create(model=model, prompt="Hello", max_tokens=3, echo=True, **GREEDY)
    assert echo.choices[0].text.startswith("Hello")
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        temperature=0.0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}, "stop_token_ids": [1, 2]},
    )
    assert chat.choices[0].message.content is not None


def test_errors_surface_as_openai_exceptions(client: openai.OpenAI, model: str, server: ServerHandle) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt=PROMPT_IDS, max_tokens=100000)
    assert "maximum context length is 512 tokens" in info.value.message
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError) as not_found:
        client.completions.create(model="no-such-model", prompt="Hi", max_tokens=2)
    assert not_found.value.code == "model_not_found" and not_found.value.param == "model"


def test_echo_with_logprobs_parses_as_openai_logprobs(client: openai.OpenAI, model: str) -> None:
    """What lm-evaluation-harness reads through this client shape: prompt tokens first, the first None."""
    out = client.completions.create(
        model=model, prompt=[PROMPT_IDS], max_tokens=0, echo=True, logprobs=1, temperature=0.0
    )
    logprobs = out.choices[0].logprobs
    assert len(logprobs.tokens) == len(PROMPT_IDS) and out.usage.completion_tokens == 0
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(lp <= 0 for lp in logprobs.token_logprobs[1:])
    assert logprobs.text_offset[0] == 0 and out.choices[0].finish_reason == "length"
