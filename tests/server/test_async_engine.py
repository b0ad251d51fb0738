"""AsyncLLMEngine on its own: abort frees pages before the next step, several prompts in one submission,
validation errors before anything runs, and a shutdown that cuts what is still open."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from pegainfer.config.compose import build_engine_config, compose
from pegainfer.engine.async_engine import AsyncLLMEngine
from pegainfer.engine.llm_engine import LLMEngine
from pegainfer.engine.request_stream import EngineOverloadedError, EngineStoppedError, PromptInput
from pegainfer.errors import RequestError
from pegainfer.sampling.sampling_params import RequestOutputKind, SamplingParams

PROMPT = PromptInput([11, 42, 7, 300, 5])


def _params(**changes: object) -> SamplingParams:
    values = {
        "temperature": 0.0,
        "ignore_eos": True,
        "max_tokens": 400,
        "output_kind": RequestOutputKind.DELTA,
    }
    return SamplingParams(**{**values, **changes})


@pytest.fixture()
def llm_engine(tiny_qwen3: Path) -> LLMEngine:
    """One engine a test: ``AsyncLLMEngine.shutdown`` shuts the engine it drives down (its executor's
    device memory released), so no later test can run on it."""
    overrides = [
        f"model.path={tiny_qwen3}",
        "device=cpu",
        "model.dtype=float32",
        "cache.cpu_kv_cache_bytes=8388608",
    ]
    return LLMEngine(build_engine_config(compose("serve", overrides)))


def _run(llm_engine: LLMEngine, body, **options: object) -> None:
    async def main() -> None:
        engine = AsyncLLMEngine(llm_engine, log_interval=0.0, **options)
        engine.start()
        try:
            await body(engine)
        finally:
            await engine.shutdown()

    asyncio.run(main())
    # Shut down or not, the engine's scheduler and pages must be left empty by every test.
    assert not llm_engine.has_unfinished_requests() and llm_engine.buffers.usage() == 0.0
    llm_engine.buffers.check_invariants()


def test_abort_frees_the_pages_before_the_next_step(llm_engine: LLMEngine) -> None:
    async def body(engine: AsyncLLMEngine) -> None:
        stream = await engine.submit("a", [PROMPT], _params())
        for _ in range(3):
            await stream.__anext__()
        steps = engine.snapshot().steps
        stream.abort()
        after = await asyncio.wrap_future(
            engine.call(lambda e: (e.stats["steps"], e.buffers.usage(), e.has_unfinished_requests()))
        )
        # At most the step already running when the abort arrived completes; then the pages are back.
        assert after[0] - steps <= 1 and after[1:] == (0.0, False)

    _run(llm_engine, body)


def test_several_prompts_stream_in_order_per_prompt(llm_engine: LLMEngine) -> None:
    async def body(engine: AsyncLLMEngine) -> None:
        inputs = [PROMPT, PromptInput([5, 6, 7], "text")]
        stream = await engine.submit("multi", inputs, _params(max_tokens=6, n=2))
        tokens = {0: [0, 0], 1: [0, 0]}
        async for index, output in stream:
            for completion in output.outputs:
                tokens[index][completion.index] += len(completion.token_ids)
        assert tokens == {0: [6, 6], 1: [6, 6]} and stream.finished

    _run(llm_engine, body)


def test_bad_input_is_rejected_whole_before_anything_runs(llm_engine: LLMEngine) -> None:
    async def body(engine: AsyncLLMEngine) -> None:
        with pytest.raises(RequestError, match="maximum context length"):
            await engine.submit("bad", [PROMPT, PromptInput([1] * 2000)], _params(max_tokens=5))
        assert engine.snapshot().open_requests == 0

    _run(llm_engine, body)


def test_waiting_bound_and_shutdown(llm_engine: LLMEngine) -> None:
    async def body(engine: AsyncLLMEngine) -> None:
        # Submitted together, they are admitted in one batch before a step: the second one already waits.
        first = await engine.submit("w1", [PROMPT], _params())
        results = await asyncio.gather(
            *(engine.submit(f"w{i}", [PROMPT], _params(max_tokens=1)) for i in range(2, 12)),
            return_exceptions=True,
        )
        assert any(isinstance(r, EngineOverloadedError) for r in results)
        for stream in results:
            if not isinstance(stream, BaseException):
                async for _ in stream:
                    pass
        with pytest.raises(RequestError, match="at most 1"):
            await engine.submit("too-many", [PROMPT], _params(n=2))
        await first.__anext__()
        await engine.shutdown(drain_timeout=0.0)
        with pytest.raises(EngineStoppedError):
            async for _ in first:
                pass
        with pytest.raises(EngineStoppedError):
            await engine.submit("late", [PROMPT], _params())

    _run(llm_engine, body, max_waiting_requests=1)
