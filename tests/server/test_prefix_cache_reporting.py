"""Prefix caching as the API reports it: ``usage.prompt_tokens_details.cached_tokens`` (plain and streamed,
completions and chat), ``cache_salt`` keeping tenants apart, the hit-rate metrics and the status line."""

from __future__ import annotations

import json
import logging
import re

import httpx
from server_harness import ServerHandle

# 40 tokens: two full 16-token pages are cached after the first request, 32 tokens hit on a repeat.
PROMPT_IDS = [(7 * i + 3) % 900 + 10 for i in range(40)]


def _sample(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert match, name
    return float(match.group(1))


def test_cached_tokens_in_usage_and_metrics(server: ServerHandle, http: httpx.Client) -> None:
    before = http.get("/metrics").text
    queries0 = _sample(before, "pegainfer_prefix_cache_queries_total")
    hits0 = _sample(before, "pegainfer_prefix_cache_hits_total")
    body = {"prompt": PROMPT_IDS, "max_tokens": 2, "temperature": 0, "cache_salt": "tenant-a"}
    first = http.post("/v1/completions", json=body).json()
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    again = http.post("/v1/completions", json=body).json()
    assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    # Another tenant's salt shares nothing; the same salt streamed reports the hit in its usage chunk.
    other = http.post("/v1/completions", json={**body, "cache_salt": "tenant-b"}).json()
    assert other["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/completions", json=streamed) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    assert events[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
    server.wait_idle()
    text = http.get("/metrics").text
    assert _sample(text, "pegainfer_prefix_cache_queries_total") - queries0 == 4 * len(PROMPT_IDS)
    assert _sample(text, "pegainfer_prefix_cache_hits_total") - hits0 == 64
    assert 0 < _sample(text, "pegainfer_prefix_cache_hit_rate") <= 1
    server.assert_pool_whole()


def test_chat_reports_cached_tokens(http: httpx.Client) -> None:
    system = "You are a terse assistant who answers every question in exactly one short sentence. " * 2
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]
    body = {"messages": messages, "max_tokens": 2}
    first = http.post("/v1/chat/completions", json=body).json()
    again = http.post("/v1/chat/completions", json=body).json()
    prompt = again["usage"]["prompt_tokens"]
    assert (
        first["usage"]["prompt_tokens_details"]["cached_tokens"]
        <= again["usage"]["prompt_tokens_details"]["cached_tokens"]
    )
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == (prompt - 1) // 16 * 16 > 0


def test_status_line_reports_the_hit_rate(caplog) -> None:
    from pegainfer.engine.async_engine import AsyncLLMEngine, EngineSnapshot

    engine = AsyncLLMEngine.__new__(AsyncLLMEngine)
    engine.log_interval = 1.0
    engine._last_log = (0.0, 0, 0, 0, 0)
    engine._snapshot = EngineSnapshot(
        num_running=1, prompt_tokens=100, generation_tokens=10, prefix_cache_queries=100, prefix_cache_hits=25
    )
    with caplog.at_level(logging.INFO, logger="pegainfer.engine.async_engine"):
        engine._maybe_log()
    assert "prefix cache hit rate 25.0%" in caplog.text
