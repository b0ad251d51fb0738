"""A fuzz pass over the server's own OpenAPI schema: request bodies drawn from the schema of each endpoint
(hypothesis-jsonschema), and arbitrary JSON in known fields; no answer may be a 5xx, every error must be
in OpenAI's format (the document's ErrorResponse), and every answer must be one the document names for
its operation (status code and media type). Generation is capped (n, max_tokens) so the pass stays a
few seconds."""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

import httpx
import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis_jsonschema import from_schema
from server_harness import API_KEY, ServerHandle

# The POST endpoints, with the schema component of their body (None: /tokenize's union of two).
ENDPOINTS = {
    "/v1/completions": "CompletionRequest",
    "/v1/chat/completions": "ChatCompletionRequest",
    "/tokenize": None,
    "/detokenize": "DetokenizeRequest",
}
# A body each endpoint serves.
BODIES = {
    "/v1/completions": {"prompt": "Hi", "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    "/tokenize": {"prompt": "Hi"},
    "/detokenize": {"tokens": [1, 2]},
}
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


@pytest.fixture(scope="module")
def served_model(server: ServerHandle) -> str:
    with server.client() as client:
        return client.get("/v1/models").json()["data"][0]["id"]


# Status codes each fuzz pass saw, by (method, path): every one must be documented for its operation.
SEEN: dict[tuple[str, str], set[int]] = defaultdict(set)


def check_documented(openapi: dict[str, Any], method: str, path: str, response: httpx.Response) -> None:
    """``response`` is one the OpenAPI document promises for ``method path``: a documented status, a
    documented media type, and for an error the documented error body."""
    SEEN[(method, path)].add(response.status_code)
    responses = openapi["paths"][path][method]["responses"]
    documented = responses.get(str(response.status_code))
    assert documented is not None, (
        f"{method.upper()} {path} answered {response.status_code}, documented: {sorted(responses)}"
    )
    media = response.headers["content-type"].split(";")[0].strip()
    content = documented.get("content", {})
    assert media in content, f"{method.upper()} {path} {response.status_code}: {media} not in {list(content)}"
    schema = content[media].get("schema")
    if media == "application/json" and schema:
        validate(openapi, schema, response.json())


def validate(openapi: dict[str, Any], schema: dict[str, Any], instance: Any) -> None:
    jsonschema.Draft202012Validator({**schema, "components": openapi["components"]}).validate(instance)


def body_strategy(
    openapi: dict[str, Any], path: str, served_model: str | None = None
) -> st.SearchStrategy[dict[str, Any]]:
    request = openapi["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    if ENDPOINTS[path] is not None:
        assert request["$ref"].endswith(ENDPOINTS[path])
    # Known fields only: extra fields are ignored by the server, and arbitrary ones are the other test's job.
    components = json.loads(json.dumps(openapi["components"]))
    for component in components["schemas"].values():
        if component.get("type") == "object":
            component["additionalProperties"] = False
    _bound_sizes(components)
    schema = {**request, "components": components}
    bodies = from_schema(schema)
    if served_model is not None:
        # Half the bodies that name a model name the served one, so they get past the model check (404).
        bodies = st.tuples(bodies, st.booleans()).map(
            lambda pair: {**pair[0], "model": served_model} if pair[1] and "model" in pair[0] else pair[0]
        )
    return bodies.map(_cap)


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
    "logit_bias",
    "tokens",
    "add_special_tokens",
    "return_token_strs",
]


def _post(client: httpx.Client, openapi: dict[str, Any], path: str, body: Any) -> httpx.Response:
    response = client.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})
    assert response.status_code < 500, (body, response.status_code, response.text[:300])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
    elif response.headers["content-type"].startswith("text/event-stream"):
        assert response.text.endswith("data: [DONE]\n\n") or '"error"' in response.text
    check_documented(openapi, "post", path, response)
    return response


def _documented_statuses(openapi: dict[str, Any], method: str, path: str) -> set[int]:
    return {int(code) for code in openapi["paths"][path][method]["responses"]}


@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_schema_driven_bodies_never_5xx(
    server: ServerHandle, openapi: dict[str, Any], served_model: str, path: str
) -> None:
    SEEN.pop(("post", path), None)
    with server.client() as client:

        @FUZZ
        @given(body=body_strategy(openapi, path, served_model))
        def check(body: dict[str, Any]) -> None:
            _post(client, openapi, path, body)

        check()
    server.assert_pool_whole()
    seen = SEEN[("post", path)]
    # Every status the fuzzer saw is documented for the operation, and schema-valid bodies do get served.
    assert seen <= _documented_statuses(openapi, "post", path), seen
    assert 200 in seen, seen


@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_arbitrary_json_fields_never_5xx(server: ServerHandle, openapi: dict[str, Any], path: str) -> None:
    base = BODIES[path]
    with server.client() as client:

        @FUZZ
        @given(overrides=st.dictionaries(st.sampled_from(FIELDS), JSON_VALUES, max_size=4), raw=JSON_VALUES)
        def check(overrides: dict[str, Any], raw: Any) -> None:
            _post(client, openapi, path, _cap({**base, **overrides}))
            _post(client, openapi, path, raw)

        check()
    server.assert_pool_whole()


def test_every_operation_answers_as_documented(server: ServerHandle, openapi: dict[str, Any]) -> None:
    """Each operation of the document, with and without the API key: a documented status and media type
    (``/metrics`` is Prometheus text, not JSON), errors in the documented error body."""
    operations = [(m, p) for p, ops in openapi["paths"].items() for m in ops]
    assert sorted(operations) == sorted(
        [("get", p) for p in ("/health", "/version", "/metrics", "/v1/models")]
        + [("post", p) for p in ENDPOINTS]
    )
    with server.client() as keyed, httpx.Client(base_url=server.url, timeout=30) as bare:
        for method, path in operations:
            for client in (keyed, bare):
                if method == "get":
                    response = client.get(path)
                    check_documented(openapi, method, path, response)
                    assert response.status_code == (401 if client is bare and path.startswith("/v1") else 200)
                    continue
                for extra in ({}, {"stream": True}, {"model": "no-such-model"}):
                    response = client.post(path, json={**BODIES[path], **extra})
                    check_documented(openapi, method, path, response)
                    if client is bare:
                        assert response.status_code == 401
    assert "text/plain" in openapi["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert "422" not in json.dumps(openapi["paths"]) and "HTTPValidationError" not in json.dumps(openapi)
    assert openapi["paths"]["/v1/completions"]["post"]["security"] == [{"HTTPBearer": []}]
    assert API_KEY not in json.dumps(openapi)


PROMPT_EDGES = [
    "",
    "x",
    [],
    [""],
    ["a", ""],
    ["a", "b"],
    [[]],
    [[1], []],
    [[1], [2, 3]],
    [1, 2],
    [-1],
    ["a"] * 129,
    [[1]] * 129,
    ["a"] * 128,
]


@pytest.mark.parametrize("prompt", PROMPT_EDGES, ids=lambda p: json.dumps(p)[:30])
@pytest.mark.parametrize("extra", [{}, {"stop": ""}, {"stop": [""]}, {"model": ""}, {"stop": ["."]}])
def test_the_schema_accepts_exactly_what_is_served(
    http: httpx.Client, openapi: dict[str, Any], prompt: Any, extra: dict[str, Any]
) -> None:
    """A request the published schema accepts is served (200); one it rejects is a 400: the constraints
    (non-empty prompts and stop strings, at most 128 prompts, token ids >= 0) are in the schema."""
    body = {"prompt": prompt, "max_tokens": 1, **extra}
    schema = openapi["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]
    try:
        validate(openapi, schema["schema"], body)
        valid = True
    except jsonschema.ValidationError:
        valid = False
    response = http.post("/v1/completions", json=body)
    assert response.status_code == (200 if valid else 400), (valid, response.text)
