"""`pegainfer serve` as a real process: SIGTERM stops new connections, lets the open requests finish within
server.drain_timeout, ends the ones still running after it with an error event, and the process exits 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from server_process import console_script, free_port, wait_healthy

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")


def test_sigterm_drains_then_cuts_and_exits_0(tmp_path_factory: pytest.TempPathFactory) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if k != "PEGAINFER_API_KEY"}
    # No model.path: the embedded demo model, written to a cache of the test session's own.
    env["PEGAINFER_CACHE"] = str(tmp_path_factory.getbasetemp() / "pegainfer-cache")
    process = subprocess.Popen(
        [
            console_script(),
            "serve",
            "device=cpu",
            "model.dtype=float32",
            "cache.cpu_kv_cache_bytes=67108864",
            f"server.port={port}",
            "server.drain_timeout=1.5",
            "server.log_interval=0.5",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_healthy(url, process)
        results: dict[str, str] = {}

        def stream(name: str, body: dict) -> None:
            text = ""
            try:
                with httpx.stream(
                    "POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60
                ) as r:
                    for line in r.iter_lines():
                        text += line + "\n"
                        if name not in results:
                            results[name] = "started"
                results[name] = text
            except httpx.HTTPError as exc:  # the server cut the response
                results[name] = f"cut: {type(exc).__name__}"

        short = {"prompt": [1, 2, 3], "max_tokens": 60, "ignore_eos": True, "n": 1}
        long = {"prompt": [1, 2, 3], "max_tokens": 1000, "ignore_eos": True, "n": 16}
        threads = [
            threading.Thread(target=stream, args=(name, body))
            for name, body in (("short", short), ("long", long))
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while len(results) < 2:
            assert time.monotonic() < deadline, results
            time.sleep(0.01)
        process.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        # Draining: no new connection is taken.
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health", timeout=2.0)
        for t in threads:
            t.join(timeout=30)
        _, stderr = process.communicate(timeout=30)
        assert process.returncode == 0, stderr[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    # The short request finished during the drain; the long one outlived the drain timeout and was cut.
    assert results["short"].rstrip().endswith("data: [DONE]"), results["short"][-300:]
    assert results["short"].count('"finish_reason":"length"') == 1
    assert "[DONE]" not in results["long"] and '"code":"shutting_down"' in results["long"], results["long"][
        -300:
    ]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert "serving 'demo-qwen3_14b-v1'" in stderr
    assert "draining open requests" in stderr
    assert "engine: prompt" in stderr  # the periodic status line
