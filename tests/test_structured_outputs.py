"""Structured outputs on the tiny Qwen3 model: every answer follows its grammar (a JSON schema, a regex, a
choice, a Lark grammar), greedy and sampled, n > 1, under preemption; bad grammars are refused before
anything is queued."""

from __future__ import annotations

import json
import re

import pytest
import torch

from pegainfer import LLM, SamplingParams, StructuredOutputsParams
from pegainfer.errors import RequestError
from pegainfer.sampling.structured import GrammarCompiler, allowed_tokens

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 6},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
        "sunny": {"type": "boolean"},
    },
    "required": ["city", "days", "sunny"],
    "additionalProperties": False,
}
PROMPTS = [[11, 42, 7, 300, 5], [99, 120, 3], [8, 8, 8, 8, 8, 8, 8]]


@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    return LLM(str(tiny_qwen3), dtype="float32", device="cpu", cpu_kv_cache_bytes=8 << 20, max_model_len=256)


def _texts(llm: LLM, structured: StructuredOutputsParams, prompts=PROMPTS, **params) -> list[str]:
    sampling = SamplingParams(max_tokens=60, structured_outputs=structured, **params)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=sampling, use_tqdm=False)
    completions = [c for o in outputs for c in o.outputs]
    assert all(c.finish_reason == "stop" for c in completions), [c.text for c in completions]
    return [c.text for c in completions]


def _follows_schema(text: str) -> bool:
    value = json.loads(text)
    return (
        set(value) == {"city", "days", "sunny"}
        and isinstance(value["city"], str) and len(value["city"]) <= 6
        and type(value["days"]) is int and 1 <= value["days"] <= 9
        and isinstance(value["sunny"], bool)
    )  # fmt: skip


@pytest.mark.parametrize("params", [dict(temperature=0.0), dict(temperature=1.0, seed=5, n=2)])
def test_json_schema_answers_follow_the_schema(llm, params):
    texts = _texts(llm, StructuredOutputsParams(json=SCHEMA), **params)
    assert len(texts) == len(PROMPTS) * params.get("n", 1)
    assert all(_follows_schema(t) for t in texts), texts


def test_regex_choice_and_lark_grammars(llm):
    assert all(
        re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)
        for t in _texts(llm, StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}"), temperature=1.0, seed=2)
    )  # noqa: E501
    choices = ["red", "green", "blue"]
    assert all(
        t in choices for t in _texts(llm, StructuredOutputsParams(choice=choices), temperature=1.0, seed=3)
    )
    lark = 'start: "ab" ("c" | "cc" | "ccc") "d"'
    assert all(
        re.fullmatch("abc{1,3}d", t)
        for t in _texts(llm, StructuredOutputsParams(grammar=lark), temperature=0.0)
    )


def test_answers_survive_preemption_and_chunked_prefill(tiny_qwen3, llm):
    """A page pool too small for the batch: preempted requests recompute, their matchers keep their state."""
    small = LLM(
        str(tiny_qwen3), dtype="float32", device="cpu", num_gpu_blocks_override=18, block_size=4,
        max_num_batched_tokens=8, max_num_seqs=3, max_model_len=72,
    )  # fmt: skip
    preempted = []
    schedule = small.engine.scheduler.schedule

    def counting():
        plan = schedule()
        preempted.extend(plan.preempted)
        return plan

    small.engine.scheduler.schedule = counting
    structured = StructuredOutputsParams(json=SCHEMA)
    assert _texts(small, structured, temperature=0.0) == _texts(llm, structured, temperature=0.0)
    assert preempted


@pytest.mark.parametrize(
    "structured",
    [dict(regex="("), dict(json={"type": 5}), dict(json="{not json"), dict(grammar="start: undefined_rule")],
    ids=["regex", "schema", "json-text", "lark"],
)
def test_grammars_that_do_not_compile_are_refused_before_queuing(llm, structured):
    with pytest.raises(RequestError, match="does not compile") as error:
        llm.engine.add_request("bad", None, SamplingParams(structured_outputs=StructuredOutputsParams(**structured)),
                               prompt_token_ids=[1, 2, 3])  # fmt: skip
    assert error.value.param == "structured_outputs" and not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("fields", [{}, dict(regex="a", choice=["a"]), dict(choice=[])])
def test_exactly_one_grammar_is_given(fields):
    with pytest.raises(RequestError, match="structured|choice"):
        StructuredOutputsParams(**fields)


class _Mask:
    """A matcher's surface as ``allowed_tokens`` reads it: a fixed bitmask of 64 tokens."""

    def __init__(self, allowed: list[int]) -> None:
        words = [0, 0]
        for token in allowed:
            words[token // 32] |= 1 << (token % 32)
        self._bytes = b"".join(w.to_bytes(4, "little") for w in words)

    def compute_bitmask(self) -> bytes:
        return self._bytes


def test_bitmasks_unpack_to_the_logits_width():
    """Bit 31 (the int32 sign) unpacks like the others; columns past the grammar's vocabulary are never
    allowed, and a narrower logits block takes its first columns."""
    masks = [_Mask([0, 31, 33]), _Mask([5, 63])]
    wide = allowed_tokens(masks, 70, torch.device("cpu"))
    assert wide.shape == (2, 70)
    assert wide[0].nonzero().flatten().tolist() == [0, 31, 33] and wide[1].nonzero().flatten().tolist() == [
        5,
        63,
    ]
    assert allowed_tokens(masks, 40, torch.device("cpu"))[1].nonzero().flatten().tolist() == [5]


def test_the_grammar_wins_over_min_tokens_bans(tiny_qwen3, llm):
    """A grammar that allows only a banned token (min_tokens bans the stop ids): the grammar's token is
    taken, so the answer stays valid; the grammar's end ends the answer, min_tokens or not."""
    first = llm.get_tokenizer().encode("yes", add_special_tokens=False)[0]
    params = SamplingParams(
        temperature=0.0, max_tokens=10, min_tokens=3, stop_token_ids=[first],
        structured_outputs=StructuredOutputsParams(choice=["yes"]),
    )  # fmt: skip
    out = llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=params, use_tqdm=False)[0].outputs[0]
    assert out.text == "yes" and out.finish_reason == "stop"


THINK_END = "</think>"


def _think_end(llm) -> int:
    [token] = llm.engine.tokenizer.encode(THINK_END, add_special_tokens=False)
    return token


def test_a_grammar_after_a_token_leaves_the_answer_free_until_it(llm):
    """``after``: the model reasons freely (here: its own greedy tokens, identical to an unconstrained
    run) until it writes ``</think>``, then follows the grammar from the next token."""
    free = llm.generate(
        prompt_token_ids=PROMPTS,
        sampling_params=SamplingParams(temperature=0.0, max_tokens=12),
        use_tqdm=False,
    )
    waiting = StructuredOutputsParams(regex="[0-9]{3}", after=THINK_END)
    held = llm.generate(
        prompt_token_ids=PROMPTS,
        sampling_params=SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=waiting),
        use_tqdm=False,
    )
    # The random model never writes </think> unprompted: nothing is constrained.
    assert [o.outputs[0].token_ids for o in held] == [o.outputs[0].token_ids for o in free]
    # Pushed to write it first (a bias the grammar then masks away): the rest is three digits, then done.
    pushed = SamplingParams(
        temperature=0.0, max_tokens=20, structured_outputs=waiting, logit_bias={_think_end(llm): 50.0}
    )
    for n, seed in ((1, None), (2, 3)):
        params = pushed.clone(n=n, seed=seed, temperature=0.0 if n == 1 else 1.0)
        outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)
        for completion in (c for o in outs for c in o.outputs):
            assert completion.token_ids[0] == _think_end(llm)
            assert re.fullmatch("[0-9]{3}", completion.text.split(THINK_END, 1)[1]), completion.text
            assert completion.finish_reason == "stop"


def test_drafts_verify_against_the_deferred_grammar(tiny_qwen3, llm):
    """Prompt-lookup drafts cross the </think> boundary: verification samples round by round (the grammar
    of later rows depends on the tokens before), so the tokens equal the run without drafts."""
    spec = LLM(
        str(tiny_qwen3), dtype="float32", device="cpu", cpu_kv_cache_bytes=8 << 20, max_model_len=256,
        speculative_num_tokens=3, speculative_method="ngram",
    )  # fmt: skip
    think = _think_end(llm)
    prompts = [p + [think] + p for p in PROMPTS]  # lookups draft </think> and what followed it
    params = SamplingParams(
        temperature=0.0, max_tokens=24, ignore_eos=True, logit_bias={think: 8.0},
        structured_outputs=StructuredOutputsParams(regex="[a-z ]{4,30}", after=THINK_END),
    )  # fmt: skip
    ours = spec.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    ref = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in ref]
    assert spec.engine.stats["spec_draft_tokens"] > 0
    took_over = [o.outputs[0] for o in ref if think in o.outputs[0].token_ids]
    assert any(a.token_ids.index(think) > 0 for a in took_over)  # free tokens first, then the grammar
    assert all(re.fullmatch("[a-z ]{4,30}", a.text.split(THINK_END, 1)[1]) for a in took_over), took_over


def test_an_after_text_of_several_tokens_is_refused(llm):
    with pytest.raises(RequestError, match="not one token") as info:
        llm.generate(
            prompt_token_ids=PROMPTS[:1],
            sampling_params=SamplingParams(
                structured_outputs=StructuredOutputsParams(choice=["a"], after="no such")
            ),
            use_tqdm=False,
        )
    assert info.value.param == "structured_outputs"


def test_a_tokenizer_llguidance_cannot_take_refuses_every_grammar(llm):
    """Said as a request error naming the field, built once (not again for every request)."""
    compiler = GrammarCompiler(llm.get_tokenizer(), 10)  # fewer logits columns than the tokenizer's ids
    for _ in range(2):
        with pytest.raises(RequestError, match="unavailable for this model's tokenizer") as error:
            compiler.matcher(StructuredOutputsParams(regex="a", param="response_format"))
        assert error.value.param == "response_format"


@pytest.mark.gpu
def test_answers_follow_the_schema_on_the_gpu(tiny_checkpoint_factory):
    """The GPU's decode path (CUDA graphs whose argmax the sampler must not take for grammar rows, async
    scheduling, bf16 logits): every answer follows the schema, greedy and sampled."""
    folder = tiny_checkpoint_factory("qwen3", seed=3, dtype="bfloat16")
    gpu = LLM(str(folder), dtype="bfloat16", device="cuda", gpu_memory_utilization=0.3, max_model_len=256)
    for params in (dict(temperature=0.0), dict(temperature=1.0, seed=5, n=2)):
        assert all(_follows_schema(t) for t in _texts(gpu, StructuredOutputsParams(json=SCHEMA), **params))
