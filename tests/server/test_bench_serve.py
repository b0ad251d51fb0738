"""`pegainfer bench serve` against the test server, at a small scale: every figure of the report is there."""

from __future__ import annotations

import json

import pytest
from server_harness import API_KEY, ServerHandle

from pegainfer.bench_serve import API_KEY_ENVS, format_report
from pegainfer.cli import main
from pegainfer.server.app import bind_socket

FIGURES = [
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
] + [
    f"{stat}_{name}_ms"
    for name in ("ttft", "tpot", "itl", "e2el")
    for stat in ("mean", "median", "p50", "p99", "std")
]


def _bench(
    capsys: pytest.CaptureFixture[str], server: ServerHandle, *args: str, key: str = API_KEY
) -> tuple[int, dict]:
    code = main(["bench", "serve", "--url", server.url, "--api-key", key, "--json", "--no-progress", *args])
    return code, json.loads(capsys.readouterr().out)


def test_fixed_concurrency_completions(capsys: pytest.CaptureFixture[str], server: ServerHandle) -> None:
    code, report = _bench(
        capsys, server, "--num-prompts", "12", "--concurrency", "4", "--input-len", "16", "--output-len", "8"
    )
    assert code == 0
    for figure in FIGURES:
        assert isinstance(report[figure], (int, float)) and report[figure] >= 0, figure
    assert report["completed"] == 12 and report["failed"] == 0 and report["errors"] == []
    assert report["total_input_tokens"] == 12 * 16 and report["total_output_tokens"] == 12 * 8
    assert report["mean_ttft_ms"] > 0 and report["mean_tpot_ms"] > 0 and report["mean_itl_ms"] > 0
    assert report["p99_e2el_ms"] >= report["median_e2el_ms"] >= report["mean_ttft_ms"] * 0.5
    table = format_report(report)
    for label in (
        "Successful requests:",
        "Request throughput (req/s):",
        "Output token throughput (tok/s):",
        "Median TTFT (ms):",
        "P99 TPOT (ms):",
        "P99 ITL (ms):",
        "Mean E2EL (ms):",
    ):
        assert label in table
    server.assert_pool_whole()


def test_poisson_rate_chat_with_random_lengths(
    capsys: pytest.CaptureFixture[str], server: ServerHandle
) -> None:
    code, report = _bench(
        capsys,
        server,
        "--endpoint",
        "/v1/chat/completions",
        "--num-prompts",
        "8",
        "--request-rate",
        "200",
        "--input-len",
        "12",
        "--output-len",
        "6",
        "--range-ratio",
        "0.5",
    )
    assert code == 0 and report["completed"] == 8 and report["request_rate"] == 200.0
    assert 8 * 3 <= report["total_output_tokens"] <= 8 * 9


def test_errors_are_counted(capsys: pytest.CaptureFixture[str], server: ServerHandle) -> None:
    code = main(
        ["bench", "serve", "--url", server.url, "--api-key", "wrong", "--json", "--no-progress"]
        + ["--num-prompts", "3", "--model", "x"]
    )
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert code == 1 and report["completed"] == 0 and report["failed"] == 3
    assert report["errors"] and report["errors"][0].startswith("HTTP 401")
    # With --model nothing is asked before the run; the refused key is still named plainly.
    assert "refused the API key" in captured.err and "--api-key" in captured.err


@pytest.fixture()
def no_key_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in API_KEY_ENVS:
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize(
    ("key", "says"),
    [(None, "needs an API key"), ("wrong", "refused the API key (HTTP 401): the key is wrong")],
)
def test_a_missing_or_wrong_key_is_named_plainly(
    capsys: pytest.CaptureFixture[str], server: ServerHandle, no_key_env: None, key: str | None, says: str
) -> None:
    args = ["bench", "serve", "--url", server.url, "--num-prompts", "2", "--no-progress"]
    code = main(args + (["--api-key", key] if key else []))
    captured = capsys.readouterr()
    assert code == 1 and captured.out == ""
    assert captured.err.startswith(f"error: {server.url} {says}"), captured.err
    assert "--api-key" in captured.err and "PEGAINFER_API_KEY" in captured.err
    assert "cannot reach" not in captured.err


@pytest.mark.parametrize("var", API_KEY_ENVS)
def test_the_key_defaults_to_the_environment(
    capsys: pytest.CaptureFixture[str],
    server: ServerHandle,
    no_key_env: None,
    monkeypatch: pytest.MonkeyPatch,
    var: str,
) -> None:
    monkeypatch.setenv(var, API_KEY)
    args = ["--num-prompts", "2", "--input-len", "4", "--output-len", "2", "--json", "--no-progress"]
    assert main(["bench", "serve", "--url", server.url, *args]) == 0
    assert json.loads(capsys.readouterr().out)["completed"] == 2


def test_an_unreachable_server_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    sock = bind_socket()  # bound, never listening: connections are refused
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        assert main(["bench", "serve", "--url", url, "--num-prompts", "1", "--no-progress"]) == 1
    finally:
        sock.close()
    assert capsys.readouterr().err.startswith(f"error: cannot reach {url}")


def test_bad_arguments_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["bench", "serve", "--num-prompts", "0"])
    assert info.value.code == 2
    assert main(["bench", "nothing"]) == 2
