"""The engine's request semantics on the tiny Qwen3 model: stops, lengths, n, seeds, logprobs, aborts."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from pegainfer import LLM, SamplingParams
from pegainfer.config.schema import CacheConfig, EngineConfig, ModelConfig
from pegainfer.errors import CheckpointError, RequestError
from pegainfer.testing.conformance import hf_logits

PROMPT = [11, 42, 7, 300, 5, 99, 120]


@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    return LLM(str(tiny_qwen3), dtype="float32", device="cpu", cpu_kv_cache_bytes=8 << 20, max_model_len=256)


def _one(llm: LLM, params: SamplingParams, prompt: list[int] = PROMPT):
    return llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0]


def _greedy(llm: LLM, n: int = 20):
    return _one(llm, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)).outputs[0]


def test_max_tokens_finishes_with_length(llm):
    out = _greedy(llm, 9)
    assert len(out.token_ids) == 9 and out.finish_reason == "length"
    assert out.text == llm.get_tokenizer().decode(out.token_ids)


def test_stop_token_id_ends_the_output(llm):
    ref = _greedy(llm).token_ids
    stop_at = next(i for i, t in enumerate(ref) if i >= 3 and t not in ref[:i])
    out = _one(llm, SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[ref[stop_at]])).outputs[0]
    assert out.token_ids == ref[: stop_at + 1]
    assert out.finish_reason == "stop" and out.stop_reason == ref[stop_at]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_a_stop_tokens_text_is_left_out_unless_asked_for(llm, skip_special_tokens):
    """As vLLM: the token that stopped the output is in its ids, its text only with
    include_stop_str_in_output (so an EOS's marker stays out of a skip_special_tokens=False answer)."""
    ref = _greedy(llm).token_ids
    stop_at = next(i for i, t in enumerate(ref) if i >= 3 and t not in ref[:i])
    decode = llm.get_tokenizer().decode
    for include in (False, True):
        params = SamplingParams(
            temperature=0, max_tokens=20, stop_token_ids=[ref[stop_at]], include_stop_str_in_output=include,
            skip_special_tokens=skip_special_tokens,
        )  # fmt: skip
        out = _one(llm, params).outputs[0]
        assert out.token_ids == ref[: stop_at + 1]
        kept = ref[: stop_at + 1] if include else ref[:stop_at]
        assert out.text == decode(kept, skip_special_tokens=skip_special_tokens)


def test_min_tokens_bans_stop_ids_until_reached(llm):
    ref = _greedy(llm).token_ids
    first = ref[0]
    out = _one(
        llm, SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[first], min_tokens=4)
    ).outputs[0]
    assert first not in out.token_ids[:4]
    assert len(out.token_ids) >= 4


def test_stop_string_truncates_text(llm):
    ref = _greedy(llm)
    text = ref.text
    stop = next(text[i : i + 3] for i in range(4, len(text) - 3) if "\ufffd" not in text[i : i + 3])
    out = _one(llm, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop])).outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]
    kept = _one(
        llm, SamplingParams(temperature=0, max_tokens=20, stop=[stop], include_stop_str_in_output=True)
    ).outputs[0]
    assert kept.text == text[: text.index(stop) + len(stop)]


def test_eos_from_generation_config_stops(tiny_qwen3):
    llm = LLM(str(tiny_qwen3), device="cpu", cpu_kv_cache_bytes=4 << 20)
    ref = _greedy(llm).token_ids
    llm.get_tokenizer().add_eos_token_ids([ref[2]])
    out = _one(llm, SamplingParams(temperature=0, max_tokens=20)).outputs[0]
    assert out.token_ids[-1] == ref[2] and out.finish_reason == "stop"
    assert out.stop_reason is None  # EOS names no stop reason
    ignored = _one(llm, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)).outputs[0]
    assert ignored.token_ids == ref
    # An EOS id that is also a stop token id stops (ignore_eos or not) and is the stop reason.
    for ignore_eos in (False, True):
        params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=ignore_eos, stop_token_ids=[ref[2]])
        both = _one(llm, params).outputs[0]
        assert both.token_ids[-1] == ref[2] and both.stop_reason == ref[2]


def test_n_sequences_with_seed_are_distinct_and_reproducible(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)
    first = _one(llm, params)
    again = _one(llm, params)
    assert [o.index for o in first.outputs] == [0, 1, 2]
    seqs = [tuple(o.token_ids) for o in first.outputs]
    assert len(set(seqs)) == 3
    assert seqs == [tuple(o.token_ids) for o in again.outputs]


def test_seeded_output_does_not_depend_on_the_batch(llm):
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = _one(llm, seeded).outputs[0].token_ids
    others = [
        SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
        seeded,
        SamplingParams(temperature=0.7, seed=9, max_tokens=30, ignore_eos=True),
    ]
    prompts = [[5, 6, 7], list(range(40, 70)), PROMPT, [1]]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=others, use_tqdm=False)
    assert outs[2].outputs[0].token_ids == alone


def test_logprobs_match_reference_distribution(llm, tiny_qwen3):
    out = _one(
        llm, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    )
    seq = out.outputs[0]
    ref = torch.log_softmax(hf_logits(tiny_qwen3, PROMPT + seq.token_ids), dim=-1)
    assert len(seq.logprobs) == 6
    for i, (token, entry) in enumerate(zip(seq.token_ids, seq.logprobs, strict=True)):
        assert token in entry and entry[token].rank == 1  # greedy picks the most likely token
        assert len(entry) == 3
        for tid, lp in entry.items():
            assert abs(lp.logprob - ref[len(PROMPT) - 1 + i, tid].item()) < 1e-4
    assert seq.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(seq.token_ids, seq.logprobs, strict=True))
    )
    assert len(out.prompt_logprobs) == len(PROMPT) and out.prompt_logprobs[0] is None
    for pos in range(1, len(PROMPT)):
        entry = out.prompt_logprobs[pos]
        assert PROMPT[pos] in entry
        assert abs(entry[PROMPT[pos]].logprob - ref[pos - 1, PROMPT[pos]].item()) < 1e-4


def test_prompt_logprobs_survive_chunked_prefill(tiny_qwen3):
    llm = LLM(str(tiny_qwen3), device="cpu", long_prefill_token_threshold=3, cpu_kv_cache_bytes=4 << 20)
    prompt = list(range(100, 117))
    out = _one(llm, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1), prompt)
    ref = torch.log_softmax(hf_logits(tiny_qwen3, prompt), dim=-1)
    assert len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        assert abs(out.prompt_logprobs[pos][prompt[pos]].logprob - ref[pos - 1, prompt[pos]].item()) < 1e-4


def test_abort_frees_pages_at_once(llm):
    engine = llm.engine
    engine.add_request("x", None, SamplingParams(max_tokens=50, ignore_eos=True), prompt_token_ids=PROMPT)
    engine.add_request("y", None, SamplingParams(max_tokens=50, ignore_eos=True), prompt_token_ids=PROMPT)
    engine.step()
    engine.step()
    assert engine.buffers.usage() > 0
    engine.abort_request("x")
    engine.abort_request("y")
    assert not engine.has_unfinished_requests()
    assert engine.buffers.usage() == 0
    engine.buffers.check_invariants()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_failing_detokenizer_ends_only_its_request(tiny_qwen3, async_scheduling):
    """A request whose detokenizing raises ends with an error (its text up to then kept); the requests
    decoding beside it go on to their own end, with the text they have alone."""
    llm = LLM(
        str(tiny_qwen3),
        dtype="float32",
        device="cpu",
        cpu_kv_cache_bytes=8 << 20,
        max_model_len=256,
        async_scheduling=async_scheduling,
    )
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = _one(llm, params).outputs[0]
    for rid in ("a", "b", "c"):
        engine.add_request(rid, None, params, prompt_token_ids=PROMPT)
    for _ in range(4):
        engine.step()
    detok = engine.outputs.sequences["b"].detokenizer
    update_one = detok.update_one
    calls = []

    def broken(token, check_stop=True):
        calls.append(token)
        if len(calls) == 2:
            raise RuntimeError("broken detokenizer")
        return update_one(token, check_stop)

    detok.update_one = broken
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in engine.step())
    failed = outputs["b"].outputs[0]
    assert failed.finish_reason == "error" and len(calls) == 2
    assert failed.text == llm.get_tokenizer().decode(failed.token_ids[: len(failed.token_ids) - 1])
    for rid in ("a", "c"):
        out = outputs[rid].outputs[0]
        assert (out.token_ids, out.text, out.finish_reason) == (alone.token_ids, alone.text, "length")
    engine.buffers.check_invariants()
    assert engine.buffers.usage() == 0


@pytest.mark.parametrize(
    ("prompt", "params", "param"),
    [
        ([], SamplingParams(), "prompt"),
        ([10**6], SamplingParams(), "prompt"),
        ([-1], SamplingParams(), "prompt"),
        ([1, 2], SamplingParams(max_tokens=10**5), "max_tokens"),
    ],
)
def test_bad_requests_are_request_errors(llm, prompt, params, param):
    with pytest.raises(RequestError) as info:
        llm.engine.add_request("bad", None, params, prompt_token_ids=prompt)
    assert info.value.param == param
    assert not llm.engine.has_unfinished_requests()


def test_context_length_message(llm):
    with pytest.raises(RequestError, match="maximum context length is 256 tokens"):
        _one(llm, SamplingParams(max_tokens=300))


def test_chat_renders_template_once(llm):
    messages = [{"role": "user", "content": "Hello there"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    expected = tok.encode(
        tok.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False
    )
    assert out.prompt_token_ids == expected
    assert out.prompt.endswith("<|im_start|>assistant\n")


def test_chat_shows_the_tools_to_the_model(llm):
    """``tools`` reach the template (as the server passes them): the prompt is the template's with them."""
    messages = [{"role": "user", "content": "Weather?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False, tools=tools)[0]
    assert out.prompt == llm.get_tokenizer().apply_chat_template(
        messages, add_generation_prompt=True, tools=tools
    )
    assert "get_weather" in out.prompt


def test_text_prompts_and_defaults_from_generation_config(llm):
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.top_k) == (0.6, 0.95, 20)
    out = llm.generate("The quick brown fox", SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    assert out.prompt_token_ids == llm.get_tokenizer().encode("The quick brown fox")
    assert len(out.outputs[0].token_ids) <= 3


@pytest.mark.parametrize("kind", ["cumulative", "delta", "final_only"])
def test_output_kinds_carry_the_same_result(llm, kind):
    from pegainfer.sampling.sampling_params import RequestOutputKind

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    params.output_kind = RequestOutputKind(kind)
    engine.add_request("kinds", None, params, prompt_token_ids=PROMPT)
    reports = []
    while engine.has_unfinished_requests():
        reports.extend(engine.step())
    final = reports[-1].outputs[0]
    assert reports[-1].finished
    reference = _greedy(llm, 12)
    if kind == "delta":
        assert len(reports) == 12
        assert sum((r.outputs[0].token_ids for r in reports), []) == reference.token_ids
        assert "".join(r.outputs[0].text for r in reports) == reference.text
        assert sum(len(r.outputs[0].logprobs) for r in reports) == 12
    else:
        assert len(reports) == (12 if kind == "cumulative" else 1)
        assert final.token_ids == reference.token_ids and final.text == reference.text


def test_reused_request_id_does_not_alias_old_decode_state(tiny_qwen3):
    """A finished request's id may be reused; the new request must not read the old one's cached rows."""
    llm = LLM(str(tiny_qwen3), device="cpu", cpu_kv_cache_bytes=4 << 20)
    engine = llm.engine
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def run(pairs):
        for rid, prompt in pairs:
            engine.add_request(rid, None, greedy, prompt_token_ids=prompt)
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
        return done

    run([("a", [5, 6, 7, 8])])
    second = run([("b", list(range(20, 40))), ("a", [300, 301, 302])])
    fresh = LLM(str(tiny_qwen3), device="cpu", cpu_kv_cache_bytes=4 << 20)
    assert second["a"] == _greedy_tokens(fresh, [300, 301, 302], 8)


def _greedy_tokens(llm, prompt, n):
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return (
        llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0]
        .outputs[0]
        .token_ids
    )


def test_threshold_does_not_block_whole_prompt_admission_without_chunking(tiny_qwen3):
    from pegainfer.config.schema import EngineConfig, ModelConfig, SchedulerConfig

    config = EngineConfig(
        model=ModelConfig(path=str(tiny_qwen3)),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=64, long_prefill_token_threshold=8, enable_chunked_prefill=False
        ),
        device="cpu",
    )
    llm = LLM.from_config(config)
    out = _greedy_tokens(llm, list(range(100, 120)), 4)
    assert len(out) == 4


def test_child_ids_cannot_collide_with_live_requests(llm):
    engine = llm.engine
    engine.add_request("a#1", None, SamplingParams(max_tokens=4), prompt_token_ids=PROMPT)
    with pytest.raises(RequestError, match="already in use"):
        engine.add_request("a", None, SamplingParams(max_tokens=4, n=2), prompt_token_ids=PROMPT)
    engine.abort_request("a#1")
    assert not engine.has_unfinished_requests()


def test_cumulative_text_is_never_taken_back(llm):
    """Cumulative reports hold back a possible stop-string prefix: each report extends the previous one."""
    ref = _greedy(llm).text
    stop = next(ref[i : i + 3] for i in range(4, len(ref) - 3) if "\ufffd" not in ref[i : i + 3])
    engine = llm.engine
    engine.add_request(
        "cum", None, SamplingParams(temperature=0, max_tokens=20, stop=[stop]), prompt_token_ids=PROMPT
    )
    texts = []
    while engine.has_unfinished_requests():
        texts.extend(o.outputs[0].text for o in engine.step())
    for earlier, later in zip(texts, texts[1:], strict=False):
        assert later.startswith(earlier)
    assert texts[-1] == ref[: ref.index(stop)]


def test_stop_strings_wait_for_min_tokens(llm):
    ref = _greedy(llm)
    first = ref.text[0]
    out = _one(llm, SamplingParams(temperature=0, max_tokens=20, stop=[first], min_tokens=6)).outputs[0]
    assert len(out.token_ids) >= 6


def test_prompt_logprobs_bound_the_prefill_chunk(tiny_qwen3):
    """Requests with prompt logprobs prefill in chunks of at most PROMPT_LOGPROBS_CHUNK tokens (their
    full-vocabulary logits are reserved for that size), with the same result as one pass."""
    from pegainfer.scheduling.scheduler import PROMPT_LOGPROBS_CHUNK

    llm = LLM(str(tiny_qwen3), device="cpu", cpu_kv_cache_bytes=8 << 20, max_model_len=1024)
    prompt = [(7 * i) % 900 for i in range(PROMPT_LOGPROBS_CHUNK + 40)]
    engine = llm.engine
    engine.add_request("pl", None, SamplingParams(max_tokens=1, prompt_logprobs=1), prompt_token_ids=prompt)
    plan = engine.scheduler.schedule()
    assert plan.scheduled[0].num_new_tokens == PROMPT_LOGPROBS_CHUNK
    engine.abort_request("pl")
    out = _one(llm, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), prompt)
    ref = torch.log_softmax(hf_logits(tiny_qwen3, prompt), dim=-1)
    for pos in (1, PROMPT_LOGPROBS_CHUNK, len(prompt) - 1):
        assert abs(out.prompt_logprobs[pos][prompt[pos]].logprob - ref[pos - 1, prompt[pos]].item()) < 1e-4


def test_top_logprob_gaps_measure_only_real_differences():
    from pegainfer.testing.conformance import top_logprob_gaps

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 40, generator=gen)
    assert top_logprob_gaps(logits + 3.0, logits).abs().max() < 1e-5  # a constant shift is no change
    noisy = logits + 0.1 * torch.randn(5, 40, generator=gen)
    assert top_logprob_gaps(noisy, logits, k=4).shape == (20,)
    assert top_logprob_gaps(noisy, logits).mean() > 0.01


def test_dummy_weights_need_only_a_config_json(tmp_path, caplog, monkeypatch):
    """``model.load_format=dummy`` from a folder with config.json alone: the demo models' tokenizer stands
    in (with a warning), and ids it does not know decode to nothing instead of failing."""
    import json

    from pegainfer_qwen3_14b.tiny import qwen3_config

    folder = tmp_path / "config-only"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(qwen3_config(4096)))
    monkeypatch.setenv("PEGAINFER_CACHE", str(tmp_path / "cache"))
    config = EngineConfig(
        model=ModelConfig(path=str(folder), load_format="dummy"),
        device="cpu",
        cache=CacheConfig(cpu_kv_cache_bytes=4 << 20),
    )
    engine_log = logging.getLogger("pegainfer.engine.llm_engine")  # the CLI's set-up may stop it propagating
    engine_log.addHandler(caplog.handler)
    try:
        llm = LLM.from_config(config)
    finally:
        engine_log.removeHandler(caplog.handler)
    assert "has no tokenizer.json" in caplog.text
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    out = llm.generate(["hello"], params, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8


def test_a_real_load_without_a_tokenizer_fails_before_any_weight_is_built(tmp_path, monkeypatch):
    from pegainfer.model import model_loader
    from pegainfer.testing.checkpoints import write_tiny_checkpoint

    folder = write_tiny_checkpoint(tmp_path / "no-tokenizer", "qwen3")
    (folder / "tokenizer.json").unlink()
    monkeypatch.setattr(model_loader, "load_model", lambda *a, **k: pytest.fail("weights were built"))
    with pytest.raises(CheckpointError, match="tokenizer.json is missing"):
        LLM(str(folder), device="cpu")


def test_speculation_needs_a_model_with_draft_layers(tiny_qwen3):
    from pegainfer.errors import ConfigError

    with pytest.raises(ConfigError, match=r"speculative\.num_tokens=2 needs a model with draft \(MTP\)"):
        LLM(str(tiny_qwen3), device="cpu", cpu_kv_cache_bytes=4 << 20, speculative_num_tokens=2)


def test_model_demo_picks_whose_demo_runs_without_a_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pegainfer.errors import ConfigError
    from pegainfer.model.model_loader import resolve_registration

    monkeypatch.setenv("PEGAINFER_CACHE", str(tmp_path))
    registration, folder, hf_config = resolve_registration(EngineConfig(demo_model="qwen35"))
    assert registration.name == "qwen35" and folder.parent == tmp_path
    assert hf_config["model_type"].startswith("qwen3_5")
    with pytest.raises(ConfigError, match="no model.path given, and demo_model: unknown model 'nosuch'"):
        resolve_registration(EngineConfig(demo_model="nosuch"))


def test_teacher_forced_logits_copy_each_steps_output(llm, monkeypatch):
    """A decode graph returns its static logits buffer, rewritten by the next replay: the harness keeps a
    copy of each step's rows (seen on a GPU: every decode row held the last step's logits)."""
    from pegainfer.testing.conformance import teacher_forced_logits

    tokens = PROMPT + [3, 8, 13]
    fresh = teacher_forced_logits(llm, tokens, prefill=len(PROMPT))
    executor, execute = llm.engine.executor, llm.engine.executor.execute
    static: dict[str, torch.Tensor] = {}

    def replay(batch):  # the logits written into one buffer, as a graph's output
        out = execute(batch)
        if out.logits is not None and len(batch.chunks[0].token_ids) == 1:
            buffer = static.setdefault("logits", torch.empty_like(out.logits))
            out.logits = buffer.copy_(out.logits)
        return out

    monkeypatch.setattr(executor, "execute", replay)
    assert torch.equal(teacher_forced_logits(llm, tokens, prefill=len(PROMPT)), fresh)
