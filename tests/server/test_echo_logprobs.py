"""``echo`` with ``logprobs`` on /v1/completions, in the shape lm-evaluation-harness's ``local-completions``
model asks for it (loglikelihood tasks) and vLLM answers it: the prompt's tokens come first in
``choices[i].logprobs``, the first with no logprob, and their logprobs are what the engine computes for the
prompt (an offline ``LLM`` run with ``prompt_logprobs`` on the same tiny model)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_harness import MAX_MODEL_LEN, ServerHandle

from pegainfer.engine.llm import LLM
from pegainfer.engine.outputs import RequestOutput
from pegainfer.sampling.sampling_params import SamplingParams

# The body lm-evaluation-harness's local-completions model sends for loglikelihood requests.
HARNESS = {"max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True, "seed": 1234}
PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [11, 12, 13]]
TEXT = "The capital of France is Paris"
# The server and the offline run compute in float32 on the CPU, but a request's sequences may be batched
# differently, and a GEMM of another shape can round the last bits differently.
CLOSE = {"rel": 1e-5, "abs": 1e-5}


@pytest.fixture(scope="module")
def offline(tiny_qwen3: Path) -> LLM:
    """The server's model, dtype and context length, run offline."""
    return LLM(
        str(tiny_qwen3),
        dtype="float32",
        device="cpu",
        cpu_kv_cache_bytes=16 << 20,
        max_model_len=MAX_MODEL_LEN,
    )


def _reference(offline: LLM, prompts: list[Any], k: int = 1) -> list[RequestOutput]:
    params = SamplingParams(prompt_logprobs=k, logprobs=k, max_tokens=1, temperature=0.0)
    if isinstance(prompts[0], str):
        return offline.generate(prompts, params, use_tqdm=False)
    return offline.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)


def _decode(offline: LLM, token_id: int) -> str:
    return offline.engine.tokenizer.decode([token_id], skip_special_tokens=False)


def _check_choice(offline: LLM, choice: dict[str, Any], ref: RequestOutput, k: int, generated: int) -> None:
    """``choice`` echoes ``ref``'s prompt with ``generated`` (0 or 1) tokens after it, logprobs as vLLM's."""
    ids = ref.prompt_token_ids
    lp = choice["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids) + generated
    # The first prompt token: nothing predicts it.
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["tokens"][0] == _decode(offline, ids[0])
    for p in range(1, len(ids)):
        entry = ref.prompt_logprobs[p]
        chosen = entry[ids[p]]
        assert lp["tokens"][p] == chosen.decoded_token
        assert lp["token_logprobs"][p] == pytest.approx(chosen.logprob, **CLOSE)
        # The k most likely tokens, and the prompt's own token among them.
        expected = {e.decoded_token: e.logprob for e in sorted(entry.values(), key=lambda e: -e.logprob)[:k]}
        expected.setdefault(chosen.decoded_token, chosen.logprob)
        top = lp["top_logprobs"][p]
        assert top.keys() == expected.keys()
        assert all(top[t] == pytest.approx(expected[t], **CLOSE) for t in top)
    prompt_text = offline.engine.tokenizer.decode(ids)
    completion = ref.outputs[0]
    if generated:
        token = completion.token_ids[0]
        assert lp["tokens"][-1] == _decode(offline, token)
        assert lp["token_logprobs"][-1] == pytest.approx(completion.logprobs[0][token].logprob, **CLOSE)
        assert choice["text"] == prompt_text + completion.text
    else:
        assert choice["text"] == prompt_text
        assert choice["finish_reason"] == "length"
    offsets = lp["text_offset"]
    assert offsets[0] == 0
    assert all(offsets[i + 1] == offsets[i] + len(lp["tokens"][i]) for i in range(len(offsets) - 1))


def _loglikelihood(choice: dict[str, Any], ctxlen: int) -> tuple[float, bool]:
    """What lm-evaluation-harness's local-completions model reads from an answer (parse_logprobs)."""
    token_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
    tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
    greedy = all(tok == max(top.values()) for tok, top in zip(token_logprobs, tops, strict=True))
    return sum(token_logprobs), greedy


def test_harness_request_with_token_ids(http: httpx.Client, offline: LLM, server: ServerHandle) -> None:
    response = http.post("/v1/completions", json={"model": server_model(http), "prompt": PROMPTS, **HARNESS})
    assert response.status_code == 200, response.text
    body = response.json()
    refs = _reference(offline, PROMPTS)
    choices = sorted(body["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1]
    for choice, ref in zip(choices, refs, strict=True):
        _check_choice(offline, choice, ref, k=1, generated=1)
    assert body["usage"] == {
        "prompt_tokens": sum(map(len, PROMPTS)),
        "completion_tokens": 2,
        "total_tokens": sum(map(len, PROMPTS)) + 2,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    # The harness's continuation log-likelihood: the prompt tokens after the context, the generated one cut.
    ctxlen = 3
    ll, greedy = _loglikelihood(choices[0], ctxlen)
    entries = refs[0].prompt_logprobs
    assert ll == pytest.approx(sum(entries[p][PROMPTS[0][p]].logprob for p in range(ctxlen, len(PROMPTS[0]))))
    assert greedy == all(entries[p][PROMPTS[0][p]].rank == 1 for p in range(ctxlen, len(PROMPTS[0])))
    server.assert_pool_whole()


def test_the_greedy_continuation_is_reported_greedy(http: httpx.Client, offline: LLM) -> None:
    context = PROMPTS[0][:4]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    continuation = offline.generate(prompt_token_ids=[context], sampling_params=params, use_tqdm=False)
    prompt = context + continuation[0].outputs[0].token_ids
    response = http.post("/v1/completions", json={"prompt": [prompt], **HARNESS})
    (choice,) = response.json()["choices"]
    ll, greedy = _loglikelihood(choice, len(context))
    assert greedy and ll < 0
    # One token off the greedy path is not greedy.
    other = prompt[:-1] + [(prompt[-1] + 1) % 1000]
    (choice,) = http.post("/v1/completions", json={"prompt": [other], **HARNESS}).json()["choices"]
    assert not _loglikelihood(choice, len(context))[1]


def test_harness_request_with_text_and_more_top_logprobs(http: httpx.Client, offline: LLM) -> None:
    response = http.post("/v1/completions", json={"prompt": TEXT, **HARNESS, "logprobs": 3})
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    (ref,) = _reference(offline, [TEXT], k=3)
    _check_choice(offline, choice, ref, k=3, generated=1)
    assert choice["text"].startswith(TEXT)
    assert response.json()["usage"]["prompt_tokens"] == len(ref.prompt_token_ids)


def test_max_tokens_0_echoes_only_the_prompt(http: httpx.Client, offline: LLM, server: ServerHandle) -> None:
    body = {"prompt": PROMPTS, **HARNESS, "max_tokens": 0}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    refs = _reference(offline, PROMPTS)
    choices = sorted(response.json()["choices"], key=lambda c: c["index"])
    for choice, ref in zip(choices, refs, strict=True):
        _check_choice(offline, choice, ref, k=1, generated=0)
        assert choice["stop_reason"] is None
    assert response.json()["usage"]["completion_tokens"] == 0
    # Without logprobs too: just the prompt.
    plain = http.post("/v1/completions", json={"prompt": TEXT, "max_tokens": 0, "echo": True}).json()
    assert plain["choices"][0]["text"] == TEXT and plain["choices"][0]["logprobs"] is None
    server.assert_pool_whole()


@pytest.mark.parametrize("max_tokens", [0, 4])
def test_streamed_echo_logprobs_match_the_whole_answer(http: httpx.Client, max_tokens: int) -> None:
    body = {"prompt": PROMPTS[0], **HARNESS, "max_tokens": max_tokens, "ignore_eos": True}
    whole = http.post("/v1/completions", json=body).json()["choices"][0]
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    chunks = [
        json.loads(line[5:])
        for line in http.post("/v1/completions", json=stream).text.splitlines()
        if line.startswith("data: {")
    ]
    pieces = [c["choices"][0] for c in chunks if c["choices"]]
    assert "".join(p["text"] for p in pieces) == whole["text"]
    for key in ("tokens", "token_logprobs", "top_logprobs"):
        assert [x for p in pieces for x in p["logprobs"][key]] == whole["logprobs"][key]
    assert pieces[0]["logprobs"]["token_logprobs"][0] is None
    assert pieces[-1]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == max_tokens


def test_n_2_echoes_the_prompt_logprobs_in_each_choice(http: httpx.Client, offline: LLM) -> None:
    body = {"prompt": PROMPTS[1], **HARNESS, "n": 2, "temperature": 1.0}
    choices = http.post("/v1/completions", json=body).json()["choices"]
    assert len(choices) == 2
    (ref,) = _reference(offline, [PROMPTS[1]])
    n = len(PROMPTS[1])
    expected = [ref.prompt_logprobs[p][PROMPTS[1][p]].logprob for p in range(1, n)]
    for choice in choices:
        token_logprobs = choice["logprobs"]["token_logprobs"]
        assert len(token_logprobs) == n + 1 and token_logprobs[0] is None
        assert token_logprobs[1:n] == pytest.approx(expected, **CLOSE)


@pytest.mark.parametrize(
    ("fields", "param"),
    [({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 0, "echo": True, "min_tokens": 1}, "min_tokens")],
)
def test_max_tokens_0_needs_echo_and_no_min_tokens(http: httpx.Client, fields: dict, param: str) -> None:
    response = http.post("/v1/completions", json={"prompt": TEXT, **fields})
    assert response.status_code == 400 and response.json()["error"]["param"] == param


def server_model(http: httpx.Client) -> str:
    return http.get("/v1/models").json()["data"][0]["id"]
