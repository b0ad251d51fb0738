"""A fuzz pass over the server's own OpenAPI schema: request bodies drawn from the schema of each endpoint
(hypothesis-jsonschema), and arbitrary JSON in known fields; no answer may be a 5xx, and every error
must be in OpenAI's format. Generation is capped (n, max_tokens) so the pass stays a few seconds."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis_jsonschema import from_schema
from server_harness import ServerHandle

ENDPOINTS = {"/v1/completions": "CompletionRequest", "/v1/chat/completions": "ChatCompletionRequest"}
FUZZ = settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)


@pytest.fixture(scope="module")
def openapi(server: ServerHandle) -> dict[str, Any]:
    return httpx.get(f"{server.url}/openapi.json").json()


def body_strategy(openapi: dict[str, Any], path: str) -> st.SearchStrategy[dict[str, Any]]:
    ref = openapi["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    assert ref.endswith(ENDPOINTS[path])
    # Known fields only: extra fields are ignored by the server, and arbitrary ones are the other test's job.
    components = json.loads(json.dumps(openapi["components"]))
    for component in components["schemas"].values():
        if component.get("type") == "object":
            component["additionalProperties"] = False
    _bound_sizes(components)
    schema = {"$ref": ref, "components": components}
    return from_schema(schema).map(_cap)


def _bound_sizes(node: Any) -> None:
    """Small arrays, objects and strings: generating big free-form JSON is what makes a fuzz pass slow."""
    if isinstance(node, dict):
        kind = node.get("type")
        if kind == "array":
            node.setdefault("maxItems", 3)
        elif kind == "object" and "properties" not in node:
            node.setdefault("maxProperties", 2)
        elif kind == "string":
            node.setdefault("maxLength", 24)
        for value in node.values():
            _bound_sizes(value)
    elif isinstance(node, list):
        for value in node:
            _bound_sizes(value)


def _cap(body: dict[str, Any]) -> dict[str, Any]:
    """Keep each request cheap: few sequences, few tokens (large values are covered by test_bad_input)."""
    body = dict(body)
    for key in ("n", "best_of"):
        if isinstance(body.get(key), int) and body[key] > 3:
            body[key] = 3
    for key in ("max_tokens", "max_completion_tokens"):
        if not isinstance(body.get(key), int) or body[key] > 8:
            body[key] = 8
    return body


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)
FIELDS = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "n",
    "temperature",
    "top_p",
    "stop",
    "seed",
    "logprobs",
    "top_logprobs",
    "stream",
    "stream_options",
    "top_k",
    "min_p",
    "stop_token_ids",
    "chat_template_kwargs",
    "echo",
    "min_tokens",
    "response_format",
    "tools",
]


def _post(client: httpx.Client, path: str, body: Any) -> httpx.Response:
    response = client.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})
    assert response.status_code < 500, (body, response.status_code, response.text[:300])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
    elif response.headers["content-type"].startswith("text/event-stream"):
        assert response.text.endswith("data: [DONE]\n\n") or '"error"' in response.text
    return response


@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_schema_driven_bodies_never_5xx(server: ServerHandle, openapi: dict[str, Any], path: str) -> None:
    with server.client() as client:

        @FUZZ
        @given(body=body_strategy(openapi, path))
        def check(body: dict[str, Any]) -> None:
            _post(client, path, body)

        check()
    server.assert_pool_whole()


@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_arbitrary_json_fields_never_5xx(server: ServerHandle, path: str) -> None:
    base = (
        {"prompt": "Hi", "max_tokens": 4}
        if path.endswith("/completions") and "chat" not in path
        else {
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 4,
        }
    )
    with server.client() as client:

        @FUZZ
        @given(overrides=st.dictionaries(st.sampled_from(FIELDS), JSON_VALUES, max_size=4), raw=JSON_VALUES)
        def check(overrides: dict[str, Any], raw: Any) -> None:
            _post(client, path, _cap({**base, **overrides}))
            _post(client, path, raw)

        check()
    server.assert_pool_whole()
