"""POST /tokenize and /detokenize: the ids the generating endpoints feed the model, the text of ids, and the
usual 400/401/404 answers."""

from __future__ import annotations

import json

import httpx
import pytest
from server_harness import MAX_MODEL_LEN, ServerHandle

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]


def _tokenizer(server: ServerHandle):  # noqa: ANN202 - the engine's Tokenizer
    return server.call(lambda engine: engine.tokenizer)


def test_a_prompt_tokenizes_as_completions_counts_it(http: httpx.Client, server: ServerHandle) -> None:
    tokenizer = _tokenizer(server)
    body = http.post("/tokenize", json={"prompt": "Hello world, again"}).json()
    assert body["tokens"] == tokenizer.encode("Hello world, again")
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == MAX_MODEL_LEN
    assert body["token_strs"] is None
    completion = http.post("/v1/completions", json={"prompt": "Hello world, again", "max_tokens": 1}).json()
    assert completion["usage"]["prompt_tokens"] == body["count"]

    with_strs = http.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert with_strs["token_strs"] == tokenizer.convert_ids_to_tokens(with_strs["tokens"])


def test_messages_tokenize_as_chat_completions_renders_them(http: httpx.Client, server: ServerHandle) -> None:
    tokenizer = _tokenizer(server)
    body = http.post("/tokenize", json={"messages": CHAT}).json()
    rendered = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
    assert body["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)
    chat = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == body["count"]
    # Without the generation prompt the rendering is shorter: the flag reaches the template.
    bare = http.post("/tokenize", json={"messages": CHAT, "add_generation_prompt": False}).json()
    assert bare["count"] < body["count"] and body["tokens"][: bare["count"]] == bare["tokens"]


def test_detokenize_inverts_tokenize(http: httpx.Client, server: ServerHandle) -> None:
    ids = http.post("/tokenize", json={"messages": CHAT}).json()["tokens"]
    text = http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    tokenizer = _tokenizer(server)
    # Special tokens stay in the text: it is the rendered prompt itself.
    assert text == tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
    assert http.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": CHAT}, "prompt"),
        ("/tokenize", {"messages": "hi"}, "messages"),
        ("/tokenize", {"messages": []}, "messages"),
        ("/tokenize", {"messages": CHAT, "continue_final_message": True}, "continue_final_message"),
        ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
        ("/tokenize", {"prompt": "\ud800"}, "prompt"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": "1 2"}, "tokens"),
    ],
)
def test_bad_bodies_are_400_naming_the_field(http: httpx.Client, path: str, body: dict, param: str) -> None:
    # json.dumps escapes the lone surrogate (\ud800), which JSON can carry and text cannot.
    response = http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


@pytest.mark.parametrize("body", [[], 5, None, "x"])
def test_a_body_that_is_no_object_says_so(http: httpx.Client, body: object) -> None:
    response = http.post("/tokenize", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "the request body must be a JSON object"


def test_another_model_is_404_and_no_key_is_401(http: httpx.Client, server: ServerHandle) -> None:
    for path, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})):
        response = http.post(path, json={**body, "model": "gpt-4o"})
        assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"
        assert httpx.post(server.url + path, json=body).status_code == 401
