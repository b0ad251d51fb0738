"""`pegainfer serve ... tp=2` as a real process on the CPU: the headline command serves the qwen35 plugin's
own demo to the official `openai` client; SIGTERM leaves no worker behind; a rank killed while requests
are open fails them with an error (the server keeps answering, /health turns 503)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from server_process import children_of, console_script, free_port, wait_healthy

pytestmark = [pytest.mark.slow, pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")]


def _serve(tmp_path_factory: pytest.TempPathFactory, *overrides: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "PEGAINFER_API_KEY"}
    env["PEGAINFER_CACHE"] = str(tmp_path_factory.getbasetemp() / "pegainfer-cache")
    process = subprocess.Popen(
        [
            console_script(),
            "serve",
            *overrides,
            "tp=2",
            "device=cpu",
            "model.dtype=float32",
            "cache.cpu_kv_cache_bytes=16777216",
            f"server.port={port}",
            "server.drain_timeout=2",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process, timeout=120)
    except BaseException:
        process.kill()
        raise
    return process, url


def _stop(process: subprocess.Popen) -> str:
    """SIGTERM the server; it must exit 0 and its workers end with it."""
    workers = children_of(process.pid)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 0, stderr[-3000:]
    deadline = time.monotonic() + 10
    while any(_running(pid) for pid in workers):
        assert time.monotonic() < deadline, f"workers {workers} outlived the server"
        time.sleep(0.05)
    return stderr


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_qwen35_tp2_serves_the_openai_client_and_sigterm_leaves_no_worker(tmp_path_factory):
    from openai import OpenAI

    process, url = _serve(tmp_path_factory, "model=qwen35")
    try:
        workers = children_of(process.pid)
        assert len(workers) >= 1  # rank 1 (and the resource tracker of its shared memory, if any)
        client = OpenAI(base_url=f"{url}/v1", api_key="unused")
        model = client.models.list().data[0].id
        assert model == "demo-qwen35-v1"
        completion = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8)
        assert completion.usage.completion_tokens == 8 and completion.choices[0].text
        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hello!"}], max_tokens=6, temperature=0
        )
        assert chat.choices[0].message.content is not None
        stream = client.completions.create(
            model=model, prompt=[1, 2, 3], max_tokens=5, stream=True, stream_options={"include_usage": True}
        )
        chunks = list(stream)
        assert chunks[-1].usage.completion_tokens == 5
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    except BaseException:
        process.kill()
        raise
    stderr = _stop(process)
    assert "tensor parallelism: 2 ranks over gloo" in stderr


def test_a_killed_rank_fails_open_requests_and_health(tmp_path_factory):
    process, url = _serve(tmp_path_factory)
    try:
        (worker,) = [pid for pid in children_of(process.pid) if b"tp_worker" in _cmdline(pid)]
        body = {"prompt": [1, 2, 3], "max_tokens": 1000, "ignore_eos": True, "stream": True}
        events = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                events.append(line)
                if len(events) == 6:
                    os.kill(worker, signal.SIGKILL)
        text = "\n".join(events)
        assert len(events) > 6 and "[DONE]" not in text and '"error"' in text, text[-500:]
        health = httpx.get(f"{url}/health", timeout=5)
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": [1], "max_tokens": 2}, timeout=5)
        assert refused.status_code == 503
    except BaseException:
        process.kill()
        raise
    assert "tensor-parallel rank 1 failed" in _stop(process)


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""
