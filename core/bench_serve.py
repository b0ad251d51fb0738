"""``pegainfer bench serve``: a load client for any OpenAI-compatible server (ours, vLLM, SGLang...).

It sends ``--num-prompts`` streaming requests, greedy with ``ignore_eos`` so every request generates exactly
``--output-len`` tokens, at a fixed ``--concurrency`` and/or a Poisson ``--request-rate``, and reports the
figures ``vllm bench serve`` reports, in the same units: TTFT, TPOT, ITL and end-to-end latency in ms
(mean, median = p50, p99, std), request throughput in req/s, token throughputs in tok/s.
Prompts are random token ids (``/v1/completions``) or random words (``/v1/chat/completions``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
from tqdm.auto import tqdm

_WORDS = (
    "the of and to in is was for on that with as by at from his her it an are were be this which or had "
    "not but have one all their there been has when who will more no if out so said what up its about into "
    "than them can only other new some could time these two may then do first any my now such like our over"
).split()


API_KEY_ENVS = ("PEGAINFER_API_KEY", "OPENAI_API_KEY")


class BenchError(Exception):
    """The benchmark cannot run against this server; the message says why and what to do."""


def auth_message(url: str, status: int, api_key: str | None) -> str:
    """What a 401/403 from the server means for the user, and how to pass a key."""
    how = f"pass one with --api-key KEY, or set {' or '.join(API_KEY_ENVS)}"
    if not api_key:
        return f"{url} needs an API key (it answered HTTP {status}) and none was given: {how}"
    return f"{url} refused the API key (HTTP {status}): the key is wrong; {how}"


@dataclass
class RequestResult:
    ok: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds to the first chunk carrying text
    latency: float = 0.0  # seconds to the end of the stream
    itl: list[float] = field(default_factory=list)  # gaps between text chunks after the first
    error: str = ""


def make_prompts(args: argparse.Namespace) -> list[tuple[Any, int, int]]:
    """(prompt, prompt length, output length) per request: token ids or words, lengths within the range."""
    rng = random.Random(args.seed)

    def length(mean: int) -> int:
        low, high = int(mean * (1 - args.range_ratio)), int(mean * (1 + args.range_ratio))
        return max(1, rng.randint(max(low, 1), max(high, 1)))

    prompts = []
    for _ in range(args.num_prompts):
        n_in, n_out = length(args.input_len), length(args.output_len)
        if args.endpoint.endswith("/chat/completions"):
            prompts.append((" ".join(rng.choice(_WORDS) for _ in range(n_in)), n_in, n_out))
        else:
            prompts.append(
                ([rng.randrange(args.token_id_low, args.vocab_size) for _ in range(n_in)], n_in, n_out)
            )
    return prompts


def _payload(args: argparse.Namespace, model: str, prompt: Any, output_len: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.endpoint.endswith("/chat/completions"):
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def _chunk_text(data: dict[str, Any]) -> str:
    text = ""
    for choice in data.get("choices") or ():
        if "delta" in choice:
            text += (choice["delta"] or {}).get("content") or ""
        else:
            text += choice.get("text") or ""
    return text


async def send_one(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], prompt_len: int
) -> RequestResult:
    """One streaming request, timed the way vLLM's client times it."""
    result = RequestResult(prompt_len=prompt_len)
    chunks = 0
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:200]
                result.error = f"HTTP {response.status_code}: {detail}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    result.ok = True
                    break
                data = json.loads(payload)
                if "error" in data:
                    result.error = str(data["error"].get("message", data["error"]))[:200]
                    return result
                if data.get("usage"):
                    # The server's counts, when it sends them, beat ours (chat prompts are words, not tokens).
                    result.output_tokens = int(data["usage"].get("completion_tokens") or 0)
                    result.prompt_len = int(data["usage"].get("prompt_tokens") or prompt_len)
                if _chunk_text(data):
                    now = time.perf_counter()
                    if chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    chunks += 1
        result.latency = time.perf_counter() - start
        if not result.ok:
            result.error = "the stream ended without [DONE]"
        elif result.output_tokens == 0:
            result.output_tokens = chunks
    except (httpx.HTTPError, json.JSONDecodeError, ValueError) as exc:
        result.ok = False
        result.error = f"{type(exc).__name__}: {exc}"[:200]
    return result


async def _resolve_model(client: httpx.AsyncClient, base: str, given: str | None, api_key: str | None) -> str:
    if given:
        return given
    response = await client.get(f"{base}/v1/models")
    if response.status_code in (401, 403):
        raise BenchError(auth_message(base, response.status_code, api_key))
    if response.status_code != 200:
        raise BenchError(
            f"GET {base}/v1/models answered HTTP {response.status_code} {response.reason_phrase}; "
            "name the model with --model"
        )
    try:
        return str(response.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise BenchError(f"GET {base}/v1/models listed no model; name the model with --model") from None


async def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Drive the server and return the report (the dict ``--json`` prints)."""
    base = args.url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(
        max_connections=args.concurrency or None, max_keepalive_connections=args.concurrency or None
    )
    timeout = httpx.Timeout(args.timeout, connect=min(args.timeout, 30.0))
    prompts = make_prompts(args)
    rng = np.random.default_rng(args.seed)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout) as client:
        model = await _resolve_model(client, base, args.model, args.api_key)
        url = f"{base}{args.endpoint}"
        gate = asyncio.Semaphore(args.concurrency) if args.concurrency else None
        bar = tqdm(total=len(prompts), desc="requests", unit="req", disable=args.no_progress, file=sys.stderr)

        async def limited(prompt: Any, n_in: int, n_out: int) -> RequestResult:
            body = _payload(args, model, prompt, n_out)
            if gate is None:
                result = await send_one(client, url, body, n_in)
            else:
                async with gate:
                    result = await send_one(client, url, body, n_in)
            bar.update(1)
            return result

        start = time.perf_counter()
        tasks = []
        for prompt, n_in, n_out in prompts:
            tasks.append(asyncio.ensure_future(limited(prompt, n_in, n_out)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(float(rng.exponential(1.0 / args.request_rate)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    return summarize(results, duration, args, model)


def _stats(name: str, values_s: list[float]) -> dict[str, float]:
    ms = np.asarray(values_s, dtype=float) * 1000.0 if values_s else np.zeros(1)
    return {
        f"mean_{name}_ms": float(ms.mean()),
        f"median_{name}_ms": float(np.median(ms)),
        f"p50_{name}_ms": float(np.percentile(ms, 50)),
        f"p99_{name}_ms": float(np.percentile(ms, 99)),
        f"std_{name}_ms": float(ms.std()),
    }


def summarize(
    results: list[RequestResult], duration: float, args: argparse.Namespace, model: str
) -> dict[str, Any]:
    """vLLM's figures from per-request results; failed requests count only as errors."""
    done = [r for r in results if r.ok]
    input_tokens = sum(r.prompt_len for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    report: dict[str, Any] = {
        "model": model,
        "endpoint": args.endpoint,
        "num_prompts": len(results),
        "concurrency": args.concurrency,
        "request_rate": args.request_rate if args.request_rate != float("inf") else "inf",
        "duration": duration,
        "completed": len(done),
        "failed": len(results) - len(done),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration if duration else 0.0,
        "output_throughput": output_tokens / duration if duration else 0.0,
        "total_token_throughput": (input_tokens + output_tokens) / duration if duration else 0.0,
    }
    report.update(_stats("ttft", [r.ttft for r in done]))
    report.update(_stats("tpot", tpots))
    report.update(_stats("itl", [gap for r in done for gap in r.itl]))
    report.update(_stats("e2el", [r.latency for r in done]))
    report["errors"] = sorted({r.error for r in results if not r.ok})[:10]
    return report


def format_report(report: dict[str, Any]) -> str:
    """The table ``vllm bench serve`` prints, with errors added."""
    rows = [
        ("Successful requests:", report["completed"]),
        ("Failed requests:", report["failed"]),
        ("Benchmark duration (s):", f"{report['duration']:.2f}"),
        ("Total input tokens:", report["total_input_tokens"]),
        ("Total generated tokens:", report["total_output_tokens"]),
        ("Request throughput (req/s):", f"{report['request_throughput']:.2f}"),
        ("Output token throughput (tok/s):", f"{report['output_throughput']:.2f}"),
        ("Total Token throughput (tok/s):", f"{report['total_token_throughput']:.2f}"),
    ]
    lines = ["{s:{c}^60}".format(s=" Serving Benchmark Result ", c="=")]
    lines += [f"{k:<45}{v:>15}" for k, v in rows]
    for key, title in (
        ("ttft", "Time to First Token"),
        ("tpot", "Time per Output Token (excl. 1st token)"),
        ("itl", "Inter-token Latency"),
        ("e2el", "End-to-end Latency"),
    ):
        lines.append("{s:{c}^60}".format(s=f" {title} ", c="-"))
        for stat, label in (("mean", "Mean"), ("median", "Median"), ("p99", "P99")):
            upper = key.upper()
            lines.append(f"{f'{label} {upper} (ms):':<45}{report[f'{stat}_{key}_ms']:>15.2f}")
    for error in report["errors"]:
        lines.append(f"error: {error}")
    lines.append("=" * 60)
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pegainfer bench serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    p.add_argument(
        "--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"]
    )
    p.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    p.add_argument(
        "--api-key",
        default=next((os.environ[v] for v in API_KEY_ENVS if os.environ.get(v)), None),
        help=f"sent as 'Authorization: Bearer KEY' (default: ${API_KEY_ENVS[0]}, else ${API_KEY_ENVS[1]})",
    )
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (words for chat)")
    p.add_argument("--output-len", type=int, default=64, help="tokens generated per request")
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths drawn in [len*(1-r), len*(1+r)]")
    p.add_argument("--vocab-size", type=int, default=1000, help="random prompt ids are below this")
    p.add_argument("--token-id-low", type=int, default=0, help="random prompt ids are at least this")
    p.add_argument(
        "--concurrency", type=int, default=None, help="most requests in flight (default: unbounded)"
    )
    p.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1:
        p.error("--num-prompts, --input-len and --output-len must be at least 1")
    if not 0.0 <= args.range_ratio < 1.0:
        p.error("--range-ratio must be in [0, 1)")
    if args.concurrency is not None and args.concurrency < 1:
        p.error("--concurrency must be at least 1")
    if args.request_rate <= 0:
        p.error("--request-rate must be positive")
    if not 0 <= args.token_id_low < args.vocab_size:
        p.error("--token-id-low must be in [0, --vocab-size)")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; exit 1 when every request failed."""
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        report = asyncio.run(run_benchmark(args))
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except httpx.HTTPError as exc:
        print(f"error: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    # With --model given nothing is asked before the run: a refused key shows in the requests' errors.
    refused = [e for e in report["errors"] if e.startswith(("HTTP 401", "HTTP 403"))]
    if refused:
        status = int(refused[0].split()[1].rstrip(":"))
        print(f"error: {auth_message(args.url.rstrip('/'), status, args.api_key)}", file=sys.stderr)
    return 0 if report["completed"] else 1
