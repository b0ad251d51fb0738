"""Raw HTTP: every bad input is a 400 in OpenAI's error format (never FastAPI's 422), an unknown model a 404,
auth is a 401, and no message leaks a file path or a stack trace."""

from __future__ import annotations

import json

import httpx
import pytest
from server_harness import MAX_MODEL_LEN, ServerHandle

CHAT = [{"role": "user", "content": "hi"}]


def _completion(**fields: object) -> dict[str, object]:
    return {"prompt": "Hello", "max_tokens": 4, **fields}


def _chat(**fields: object) -> dict[str, object]:
    return {"messages": CHAT, "max_tokens": 4, **fields}


BAD_BODIES = [
    # (endpoint, body, param the error should name or None)
    ("completions", _completion(max_tokens=-1), "max_tokens"),
    ("completions", _completion(max_tokens=0), "max_tokens"),
    ("completions", _completion(max_tokens=10**30), "max_tokens"),
    ("completions", _completion(max_tokens=MAX_MODEL_LEN), "max_tokens"),
    ("completions", _completion(max_tokens="ten"), "max_tokens"),
    ("completions", _completion(max_tokens=4.5), "max_tokens"),
    ("completions", _completion(n=0), "n"),
    ("completions", _completion(n=10_000), "n"),
    ("completions", _completion(n=True), "n"),
    ("completions", _completion(temperature=-0.5), "temperature"),
    ("completions", _completion(temperature=1e9), "temperature"),
    ("completions", _completion(temperature="hot"), "temperature"),
    ("completions", _completion(top_p=0.0), "top_p"),
    ("completions", _completion(top_p=1.5), "top_p"),
    ("completions", _completion(top_k=-5), "top_k"),
    ("completions", _completion(min_p=2.0), "min_p"),
    ("completions", _completion(repetition_penalty=0.0), "repetition_penalty"),
    ("completions", _completion(presence_penalty=3.0), "presence_penalty"),
    ("completions", _completion(frequency_penalty=-9), "frequency_penalty"),
    ("completions", _completion(logprobs=21), "logprobs"),
    ("completions", _completion(seed=2**64), "seed"),
    ("completions", _completion(seed="x"), "seed"),
    ("completions", _completion(stop=[""]), "stop"),
    ("completions", _completion(stop=""), "stop"),
    ("completions", _completion(stop=5), "stop"),
    ("completions", _completion(min_tokens=10), "min_tokens"),
    ("completions", _completion(stop_token_ids=[10**9]), "stop_token_ids"),
    ("completions", _completion(stop_token_ids=[-1]), "stop_token_ids"),
    ("completions", _completion(stream="yes"), "stream"),
    ("completions", _completion(stream_options={"include_usage": True}), "stream_options"),
    ("completions", _completion(logit_bias={"five": 1.0}), "logit_bias"),
    ("completions", _completion(logit_bias={" 5": 1.0}), "logit_bias"),
    ("completions", _completion(logit_bias={"+5": 1.0}), "logit_bias"),
    ("completions", _completion(guided_regex="a", guided_choice=["a"]), "guided_choice"),
    ("completions", _completion(guided_choice=[]), "guided_choice"),
    ("completions", _completion(structured_outputs={"regex": "a", "choice": ["a"]}), "structured_outputs"),
    (
        "completions",
        _completion(
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}
        ),
        "response_format",
    ),
    (
        "chat/completions",
        _chat(response_format={"type": "json_object"}, structured_outputs={"regex": "a"}),
        "response_format",
    ),
    (
        "chat/completions",
        _chat(
            tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="required", guided_regex="a"
        ),
        "guided_regex",
    ),
    (
        "chat/completions",
        _chat(
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice={"type": "function", "function": {"name": "g"}},
        ),
        "tool_choice",
    ),
    ("completions", _completion(allowed_token_ids=[]), "allowed_token_ids"),
    ("completions", _completion(allowed_token_ids=[10**9]), "allowed_token_ids"),
    ("completions", _completion(allowed_token_ids=[-2]), "allowed_token_ids"),
    (
        "chat/completions",
        _chat(allowed_token_ids=[5], response_format={"type": "json_object"}),
        "allowed_token_ids",
    ),
    ("completions", _completion(logit_bias={"-1": 1.0}), "logit_bias"),
    ("completions", _completion(logit_bias={str(10**9): 1.0}), "logit_bias"),
    ("completions", _completion(logit_bias={"5": 101}), "logit_bias"),
    ("chat/completions", _chat(logit_bias={"5": "high"}), "logit_bias"),
    ("completions", _completion(prompt=""), "prompt"),
    ("completions", _completion(prompt=[]), "prompt"),
    ("completions", _completion(prompt=[[]]), "prompt"),
    ("completions", _completion(prompt=[""]), "prompt"),
    ("completions", _completion(prompt=None), "prompt"),
    ("completions", _completion(prompt={"text": "x"}), "prompt"),
    ("completions", _completion(prompt=[1, "a"]), "prompt"),
    ("completions", _completion(prompt=[10**9]), "prompt"),
    ("completions", _completion(prompt=[-3, 4]), "prompt"),
    ("completions", _completion(prompt=[-(2**70)], echo=True), "prompt"),
    ("completions", _completion(prompt=[[2**70]], echo=True), "prompt"),
    ("completions", _completion(prompt=[1] * (MAX_MODEL_LEN + 1)), "max_tokens"),
    ("completions", {"max_tokens": 4}, "prompt"),
    ("chat/completions", _chat(messages=[]), "messages"),
    ("chat/completions", _chat(messages="hi"), "messages"),
    ("chat/completions", _chat(messages=[{"role": "wizard", "content": "x"}]), "messages"),
    ("chat/completions", _chat(messages=[{"content": "x"}]), "messages"),
    ("chat/completions", _chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "messages"),
    ("chat/completions", _chat(max_completion_tokens=-4), "max_completion_tokens"),
    ("chat/completions", _chat(max_completion_tokens=10**6), "max_tokens"),
    ("chat/completions", _chat(top_logprobs=3), "top_logprobs"),
    ("chat/completions", _chat(logprobs=True, top_logprobs=99), "top_logprobs"),
    ("chat/completions", _chat(logprobs=3), "logprobs"),
    ("chat/completions", _chat(model=""), "model"),
    ("chat/completions", _chat(chat_template_kwargs={"messages": []}), "chat_template_kwargs"),
    ("chat/completions", _chat(chat_template_kwargs=[1]), "chat_template_kwargs"),
    ("chat/completions", _chat(response_format={"type": "json_schema"}), "response_format"),
    ("chat/completions", _chat(tool_choice="required"), "tool_choice"),
]


@pytest.mark.parametrize(("endpoint", "body", "param"), BAD_BODIES, ids=lambda v: json.dumps(v)[:60])
def test_bad_bodies_are_400_in_openai_format(
    http: httpx.Client, server: ServerHandle, endpoint: str, body: dict, param: str | None
) -> None:
    response = http.post(f"/v1/{endpoint}", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param, error
    _assert_no_leak(error["message"], server)


@pytest.mark.parametrize(
    ("endpoint", "body"),
    [("completions", _completion(model="no-such-model")), ("chat/completions", _chat(model="gpt-4o"))],
)
def test_unknown_model_is_404_model_not_found(
    http: httpx.Client, server: ServerHandle, endpoint: str, body: dict
) -> None:
    """OpenAI's answer: 404, with its error body naming the model parameter."""
    response = http.post(f"/v1/{endpoint}", json=body)
    assert response.status_code == 404, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert error["type"] == "invalid_request_error" and body["model"] in error["message"]
    _assert_no_leak(error["message"], server)


RAW_BODIES = [
    b"{",
    b"",
    b"null",
    b"[]",
    b'"prompt"',
    b"42",
    b'{"prompt": "x", "max_tokens": NaN}',
    b'{"prompt": "x", "temperature": Infinity}',
    b'{"prompt": "\\ud800", "max_tokens": 2}',
    b"\xff\xfe\x00garbage",
]


@pytest.mark.parametrize("raw", RAW_BODIES, ids=repr)
def test_malformed_json_is_400(http: httpx.Client, server: ServerHandle, raw: bytes) -> None:
    for endpoint in ("completions", "chat/completions"):
        response = http.post(f"/v1/{endpoint}", content=raw, headers={"Content-Type": "application/json"})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["type"] == "invalid_request_error"
        _assert_no_leak(response.json()["error"]["message"], server)


@pytest.mark.parametrize(
    "fields",
    [
        {"top_k": 10**30, "temperature": 1.0},
        {"seed": 2**63 - 1, "n": 3, "temperature": 1.0},
        {"seed": -(2**63), "temperature": 1.0},
        {"min_tokens": 4, "max_tokens": 4, "stop_token_ids": [0, 1]},
        {"temperature": 1e-9, "top_p": 1e-9, "min_p": 1.0},
        {"logprobs": 20, "n": 2, "temperature": 100.0},
        {"repetition_penalty": 10.0, "presence_penalty": 2.0, "frequency_penalty": -2.0},
        {"max_tokens": None, "prompt": [1] * (MAX_MODEL_LEN - 2)},
    ],
    ids=lambda v: json.dumps(v)[:50],
)
def test_extreme_valid_values_are_served(http: httpx.Client, server: ServerHandle, fields: dict) -> None:
    response = http.post("/v1/completions", json=_completion(**fields))
    assert response.status_code == 200, response.text
    assert server.engine.is_alive


def test_context_length_message_is_openais(http: httpx.Client) -> None:
    response = http.post("/v1/completions", json=_completion(prompt=[5] * 10, max_tokens=MAX_MODEL_LEN))
    message = response.json()["error"]["message"]
    assert message.startswith(f"This model's maximum context length is {MAX_MODEL_LEN} tokens.")


def test_wrong_content_type_is_400(http: httpx.Client) -> None:
    response = http.post("/v1/completions", content=b"prompt=x", headers={"Content-Type": "text/plain"})
    assert response.status_code == 400


def test_auth(server: ServerHandle) -> None:
    with httpx.Client(base_url=server.url, timeout=10) as bare:
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": "Basic abc"},
            {"Authorization": "Bearer"},
        ):
            for method, path in (
                ("GET", "/v1/models"),
                ("POST", "/v1/completions"),
                ("POST", "/v1/chat/completions"),
            ):
                response = bare.request(method, path, headers=headers, json=_completion())
                assert response.status_code == 401, (headers, path)
                error = response.json()["error"]
                assert error["code"] == "invalid_api_key" and set(error) == {
                    "message",
                    "type",
                    "param",
                    "code",
                }
        # Probes and scrapers need no key.
        for path in ("/health", "/metrics", "/version"):
            assert bare.get(path).status_code == 200
        assert (
            bare.get(
                "/v1/models", headers={"Authorization": f"bearer {server.headers['Authorization'][7:]}"}
            ).status_code
            == 200
        )


def test_unknown_routes_and_methods_use_the_error_format(http: httpx.Client) -> None:
    response = http.get("/v1/nothing-here")
    assert response.status_code == 404 and response.json()["error"]["type"] == "not_found_error"
    response = http.get("/v1/completions")
    assert response.status_code == 405 and "error" in response.json()


def test_unknown_fields_are_ignored(http: httpx.Client) -> None:
    response = http.post("/v1/completions", json=_completion(some_future_field={"a": 1}, store=True))
    assert response.status_code == 200


def _assert_no_leak(message: str, server: ServerHandle) -> None:
    folder = str(server.engine.engine.executor.info.folder)
    assert folder not in message and "Traceback" not in message and ".py" not in message, message
