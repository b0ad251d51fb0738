"""Concurrency on the tiny model: 64 streaming clients at once, and a storm of clients that hang up at random
points; afterwards the page pool must be whole (nothing leaked, nothing owned twice)."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
from server_harness import ServerHandle

PROMPT_IDS = [11, 42, 7, 300, 5, 99, 120]


def parse_stream(text: str) -> list[dict]:
    """The JSON chunks of an SSE body, checking its framing: only `data:` events, `[DONE]` exactly last."""
    events = text.split("\n\n")
    assert events[-1] == "", "the stream must end with a blank line"
    events = events[:-1]
    assert events and events[-1] == "data: [DONE]", events[-3:]
    chunks = []
    for event in events[:-1]:
        assert event.startswith("data: ") and "\n" not in event, event
        chunks.append(json.loads(event[6:]))
    return chunks


def check_choices(chunks: list[dict], n: int, max_tokens: int, chat: bool) -> None:
    """Every choice ends exactly once, in its last chunk; the usage chunk matches; text is all strings."""
    finish: dict[int, str] = {}
    for chunk in chunks:
        if chunk.get("usage"):
            assert chunk["choices"] == []
            assert chunk["usage"]["completion_tokens"] == n * max_tokens
            continue
        for choice in chunk["choices"]:
            assert choice["index"] not in finish, "output after finish_reason"
            text = choice["delta"].get("content", "") if chat else choice["text"]
            assert isinstance(text, str)
            if choice["finish_reason"] is not None:
                finish[choice["index"]] = choice["finish_reason"]
    assert finish == dict.fromkeys(range(n), "length")
    assert chunks[-1].get("usage"), "the usage chunk comes last"


async def one_stream(client: httpx.AsyncClient, i: int, rng: random.Random) -> None:
    chat = i % 2 == 1
    n = 2 if i % 8 == 0 else 1
    max_tokens = rng.randint(4, 24)
    body = {
        "max_tokens": max_tokens,
        "n": n,
        "temperature": rng.choice([0.0, 0.8]),
        "seed": i,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if chat:
        body["messages"] = [{"role": "user", "content": f"Request number {i}, tell me a story."}]
    else:
        body["prompt"] = PROMPT_IDS[: 2 + i % 5] + [i]
    response = await client.post(f"/v1/{'chat/' if chat else ''}completions", json=body)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    check_choices(parse_stream(response.text), n, max_tokens, chat)


def test_64_concurrent_streams_complete_and_leave_the_pool_whole(server: ServerHandle) -> None:
    async def main() -> None:
        rng = random.Random(0)
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(
            base_url=server.url, headers=server.headers, limits=limits, timeout=60
        ) as client:
            await asyncio.gather(*(one_stream(client, i, rng) for i in range(64)))

    start = time.monotonic()
    asyncio.run(main())
    assert time.monotonic() - start < 60
    server.assert_pool_whole()


async def hang_up(client: httpx.AsyncClient, i: int, rng: random.Random) -> None:
    """A client that leaves: before the response, after a few chunks, or (non-streaming) by timing out."""
    body = {"prompt": PROMPT_IDS + [i], "max_tokens": 400, "ignore_eos": True, "n": 1 + i % 3}
    how = i % 3
    try:
        if how == 2:  # non-streaming, the client gives up
            await client.post("/v1/completions", json=body, timeout=rng.uniform(0.01, 0.3))
            return
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            keep = rng.randint(0, 12) if how == 1 else 0
            async for _ in response.aiter_lines():
                if keep <= 0:
                    break
                keep -= 1
    except httpx.TimeoutException:
        pass


def test_disconnect_storm_leaks_no_pages(server: ServerHandle) -> None:
    before = server.call(lambda e: e.stats["generation_tokens"])

    async def main() -> None:
        rng = random.Random(1)
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=30) as client:
            await asyncio.gather(*(hang_up(client, i, rng) for i in range(48)))

    asyncio.run(main())
    server.assert_pool_whole()
    generated = server.call(lambda e: e.stats["generation_tokens"]) - before
    # Had the requests run on unheard, 48 x ~2 x 400 tokens would have been generated.
    assert generated < 48 * 400 // 2, generated


def test_disconnect_mid_stream_aborts_the_request(server: ServerHandle) -> None:
    server.wait_idle()
    before = server.call(lambda e: e.stats["generation_tokens"])
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=30) as client:
        body = {"prompt": PROMPT_IDS, "max_tokens": 500, "ignore_eos": True, "stream": True}
        with client.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            for _ in range(6):
                next(lines)
            assert server.call(lambda e: e.buffers.usage()) > 0
    server.assert_pool_whole()
    generated = server.call(lambda e: e.stats["generation_tokens"]) - before
    assert generated < 400, f"{generated} tokens generated for a client that left after 3"
