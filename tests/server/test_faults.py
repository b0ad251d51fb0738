"""Faults: a request whose processing raises fails alone (500); a dead engine makes /health 503 and fails
every request fast; a full waiting queue answers 503 with Retry-After; /metrics reports what happened."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_harness import ServerHandle, start_server

PROMPT_IDS = [11, 42, 7, 300, 5, 99, 120]
POISON_SEED = 4242


@pytest.fixture()
def poisoned(server: ServerHandle) -> Iterator[ServerHandle]:
    """Requests with seed=POISON_SEED raise inside the engine's per-token processing."""

    def patch(engine) -> None:
        original = engine.outputs.after_tokens

        def after_tokens(done):
            if any(seq.request.sampling_params.seed == POISON_SEED for seq, _, _ in done):
                raise RuntimeError("injected failure in /very/secret/path.py")
            return original(done)

        engine.outputs.after_tokens = after_tokens

    server.call(patch)
    yield server
    server.call(lambda engine: engine.outputs.__dict__.pop("after_tokens"))


def test_a_failing_request_gets_500_and_the_others_finish(poisoned: ServerHandle) -> None:
    async def main() -> None:
        async with httpx.AsyncClient(base_url=poisoned.url, headers=poisoned.headers, timeout=30) as client:
            healthy = {"prompt": PROMPT_IDS, "max_tokens": 40, "ignore_eos": True, "temperature": 0.0}
            sick = {"prompt": PROMPT_IDS, "max_tokens": 40, "seed": POISON_SEED, "temperature": 1.0}
            responses = await asyncio.gather(
                client.post("/v1/completions", json=healthy),
                client.post("/v1/completions", json=sick),
                client.post(
                    "/v1/chat/completions",
                    json={**sick, "prompt": None, "messages": [{"role": "user", "content": "x"}]},
                ),
                client.post("/v1/completions", json={**sick, "stream": True}),
                client.post("/v1/completions", json={**healthy, "stream": True}),
            )
        ok, bad, bad_chat, bad_stream, ok_stream = responses
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 40
        for response in (bad, bad_chat):
            assert response.status_code == 500
            error = response.json()["error"]
            assert error["type"] == "server_error" and "secret" not in error["message"]
        # A stream has sent its 200 already: the failure arrives as an error event, and the stream ends.
        assert bad_stream.status_code == 200
        assert '"error"' in bad_stream.text and "secret" not in bad_stream.text
        assert ok_stream.status_code == 200 and ok_stream.text.endswith("data: [DONE]\n\n")

    asyncio.run(main())
    poisoned.assert_pool_whole()
    assert poisoned.engine.is_alive
    metrics = httpx.get(f"{poisoned.url}/metrics").text
    assert _sample(metrics, 'pegainfer_request_success_total{finished_reason="error"}') >= 3


def test_metrics_report_engine_state_and_latencies(server: ServerHandle, http: httpx.Client) -> None:
    assert http.post("/v1/completions", json={"prompt": PROMPT_IDS, "max_tokens": 5}).status_code == 200
    server.wait_idle()
    text = http.get("/metrics").text
    for name in (
        "pegainfer_num_requests_running",
        "pegainfer_num_requests_waiting",
        "pegainfer_kv_cache_usage_perc",
        "pegainfer_engine_alive",
    ):
        assert re.search(rf"^{name} ", text, re.M), name
    assert _sample(text, "pegainfer_prompt_tokens_total") >= len(PROMPT_IDS)
    assert _sample(text, "pegainfer_generation_tokens_total") >= 5
    for histogram in ("time_to_first_token", "time_per_output_token", "e2e_request_latency"):
        assert _sample(text, f"pegainfer_{histogram}_seconds_count") >= 1
    assert http.post("/v1/completions", json={"prompt": ""}).status_code == 400
    assert _sample(http.get("/metrics").text, 'pegainfer_http_errors_total{status="400"}') >= 1
    assert http.get("/version").json()["version"]
    assert http.get("/health").json() == {"status": "ok"}


def test_full_waiting_queue_answers_503_with_retry_after(tiny_qwen3: Path) -> None:
    handle = start_server(tiny_qwen3, ["scheduler.max_num_seqs=1"], max_waiting_requests=1)
    handle.call(_slow_down)  # ~10 ms a step, so the running request outlives the test's requests
    try:
        with handle.client() as client:
            long = {"prompt": PROMPT_IDS, "max_tokens": 150, "ignore_eos": True, "stream": True}
            with client.stream("POST", "/v1/completions", json=long) as running:
                lines = running.iter_lines()  # kept: a dropped iterator closes the connection
                next(lines)  # admitted and running

                async def waiting_then_rejected() -> tuple[httpx.Response, httpx.Response]:
                    async with httpx.AsyncClient(
                        base_url=handle.url, headers=handle.headers, timeout=30
                    ) as ac:
                        queued = asyncio.ensure_future(
                            ac.post("/v1/completions", json={**long, "stream": False, "max_tokens": 5})
                        )
                        deadline = time.monotonic() + 10
                        while handle.engine.snapshot().num_waiting < 1:
                            assert time.monotonic() < deadline
                            await asyncio.sleep(0.005)
                        rejected = await ac.post("/v1/completions", json={**long, "stream": False})
                        return await queued, rejected

                queued, rejected = asyncio.run(waiting_then_rejected())
                assert rejected.status_code == 503 and rejected.headers["Retry-After"] == "1"
                assert rejected.json()["error"]["code"] == "overloaded"
                assert queued.status_code == 200  # admitted requests are still served
                text = "".join(f"{line}\n" for line in lines)
                assert text.rstrip().endswith("data: [DONE]")
        handle.assert_pool_whole()
    finally:
        handle.stop()


def test_dead_engine_fails_open_and_new_requests_and_health(tiny_qwen3: Path) -> None:
    handle = start_server(tiny_qwen3)
    try:
        with handle.client() as client:
            body = {"prompt": PROMPT_IDS, "max_tokens": 400, "ignore_eos": True, "stream": True}
            with client.stream("POST", "/v1/completions", json=body) as response:
                lines = response.iter_lines()
                next(lines)

                def explode(*args, **kwargs):
                    raise RuntimeError("device lost at /secret/location")

                handle.call(lambda engine: setattr(engine.executor, "execute", explode))
                rest = "\n".join(lines)
            assert '"error"' in rest and "engine" in rest and "secret" not in rest
            assert not handle.engine.is_alive
            health = client.get("/health")
            assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
            start = time.monotonic()
            new = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert new.status_code == 503 and time.monotonic() - start < 1.0
            assert _sample(client.get("/metrics").text, "pegainfer_engine_alive") == 0.0
    finally:
        handle.stop()


def _slow_down(engine) -> None:
    execute = engine.executor.execute

    def slow(batch):
        time.sleep(0.01)
        return execute(batch)

    engine.executor.execute = slow


def _sample(metrics: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", metrics, re.M)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))
