"""Speculative decoding in the scheduler and the engine's bookkeeping, without a model.

Drafts ride along a decoding request's step (``1 + len(spec)`` tokens when the budget and the pages allow,
else none), ``update_after_step`` counts the known token only, ``accept_spec_tokens`` the accepted drafts:
rejected ones are rolled back. A simulated engine loop uses the real sampler, ``sample_and_verify`` and
``SpeculativeDecoder`` with a scripted "model" whose next token is a fixed function of the position, and a
fake drafter that is right or wrong at random: the output must not depend on the drafts.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pegainfer.config.schema import SchedulerConfig, SpeculativeConfig
from pegainfer.engine.request import Request, RequestStatus
from pegainfer.errors import ConfigError
from pegainfer.executor.executor import DraftInput, Executor, ExecutorOutput
from pegainfer.memory.buffer_manager import PagedBufferManager
from pegainfer.memory.buffer_specs import PagedKVSpec, RecurrentStateSpec
from pegainfer.memory.memory_plan import MemoryPlan
from pegainfer.sampling.sampler import Sampler
from pegainfer.sampling.sampling_params import SamplingParams
from pegainfer.scheduling.scheduler import ContinuousBatchingScheduler, ScheduledRequest, SchedulerOutput
from pegainfer.scheduling.speculative import (
    SpeculativeDecoder,
    draft_buffer_specs,
    paged_buffer_specs,
    sample_and_verify,
)

SPECS = [PagedKVSpec(layer_index=0, num_kv_heads=1, head_dim=1, dtype=torch.float32)]
VOCAB = 160
STOP = 149


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def make_scheduler(
    num_blocks: int = 256, block_size: int = 4, **config: object
) -> tuple[ContinuousBatchingScheduler, PagedBufferManager]:
    plan = MemoryPlan(budget=0, weight_bytes=0, block_size=block_size, num_blocks=num_blocks, page_bytes=1)
    buffers = PagedBufferManager(plan)
    return ContinuousBatchingScheduler(SchedulerConfig(**config), buffers), buffers


def make_request(rid: object, prompt_len: int, max_tokens: int = 8, temperature: float = 0.0) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature)
    return Request(str(rid), list(range(prompt_len)), params)


def target(request: Request, position: int) -> int:
    """The scripted model's token at ``position`` (>= the prompt length) of ``request``."""
    return 100 + (int(request.request_id) * 31 + position * 7) % 50


def decoding(sched: ContinuousBatchingScheduler, rid: str, prompt_len: int = 6, **kw: object) -> Request:
    """A request whose prompt is computed and whose first token is sampled: it decodes from now on."""
    req = make_request(rid, prompt_len, **kw)
    sched.add_request(req)
    out = sched.schedule()
    sched.update_after_step(out)
    req.append_output_token(target(req, req.num_tokens))
    return req


# ------------------------------------------------------------------------------------ planning drafts


def test_drafts_are_scheduled_with_the_last_token_and_sample() -> None:
    sched, buffers = make_scheduler(block_size=4)
    req = decoding(sched, "1", prompt_len=6)  # 7 tokens, 6 computed
    req.spec_token_ids = [5, 6, 7]
    assert req.num_tokens_with_spec == 10
    (item,) = sched.schedule().scheduled
    assert (item.start, item.num_new_tokens, item.samples, item.spec_token_ids) == (6, 4, True, [5, 6, 7])
    assert len(buffers.block_table("1")) == cdiv(6 + 4, 4)
    sched.update_after_step(SchedulerOutput([item]))
    assert req.num_computed_tokens == 7  # the known token only; drafts wait for verification


@pytest.mark.parametrize(("budget", "expected"), [(3, [5, 6]), (2, [5]), (1, [])])
def test_drafts_are_cut_to_the_token_budget(budget: int, expected: list[int]) -> None:
    sched, _ = make_scheduler(max_num_batched_tokens=budget)
    req = decoding(sched, "1", prompt_len=1)
    req.spec_token_ids = [5, 6, 7]
    (item,) = sched.schedule().scheduled
    assert item.spec_token_ids == expected and item.num_new_tokens == 1 + len(expected) and item.samples
    assert req.spec_token_ids == expected


def test_drafts_never_preempt_and_are_dropped_when_pages_are_short() -> None:
    sched, buffers = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    a = decoding(sched, "1", prompt_len=7)
    b = make_request("2", 3)
    sched.add_request(b)
    step_out = sched.schedule()
    sched.update_after_step(step_out)
    b.append_output_token(target(b, b.num_tokens))
    a.append_output_token(target(a, a.num_tokens))
    # a: 9 tokens, 8 computed, 2 pages; b: 4 tokens, 3 computed, 1 page; 1 page free.
    assert buffers.pool.num_free == 1
    a.spec_token_ids = [1, 2, 3, 4, 5]  # 6 tokens from position 8 need 2 more pages: only 1 is free
    out = sched.schedule()
    assert not out.preempted
    assert [(s.request.request_id, s.num_new_tokens, s.spec_token_ids) for s in out.scheduled] == [
        ("1", 1, []),
        ("2", 1, []),
    ]
    assert a.spec_token_ids == []
    buffers.check_invariants()


def test_drafts_only_for_a_request_that_decodes() -> None:
    """Drafts on a request that still has uncomputed tokens (a preempted one resuming) are ignored."""
    sched, _ = make_scheduler(max_num_batched_tokens=4)
    req = make_request("1", prompt_len=10)
    sched.add_request(req)
    req.spec_token_ids = [1, 2]
    sched._waiting.popleft()
    sched.running.append(req)
    req.status = RequestStatus.RUNNING
    (item,) = sched.schedule().scheduled
    assert (item.num_new_tokens, item.spec_token_ids, item.samples) == (4, [], False)


def test_preemption_clears_the_drafts() -> None:
    sched, buffers = make_scheduler(num_blocks=3, block_size=4, max_num_batched_tokens=64)
    a = decoding(sched, "1", prompt_len=3)
    b = decoding(sched, "2", prompt_len=7)  # a: 1 page, b: 2 pages: the pool is full
    assert buffers.pool.num_free == 0
    b.spec_token_ids = [1, 2]
    a.append_output_token(1)
    a.spec_token_ids = [3]
    out = sched.schedule()
    # a (4 known + 1 draft -> needs page 2) drops its draft, then preempts b to get its page
    assert b in out.preempted and b.spec_token_ids == [] and b.num_computed_tokens == 0
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("1", 1)]
    buffers.check_invariants()


# ------------------------------------------------------------------------------------------- rollback


@pytest.mark.parametrize("accepted", [0, 1, 3])
def test_accepting_drafts_moves_the_computed_count(accepted: int) -> None:
    sched, buffers = make_scheduler(block_size=4)
    req = decoding(sched, "1", prompt_len=6)
    req.spec_token_ids = [5, 6, 7]
    out = sched.schedule()
    (item,) = out.scheduled
    sched.update_after_step(out)
    for token in [5, 6, 7][:accepted] + [9]:
        req.append_output_token(token)
    sched.accept_spec_tokens(item, accepted)
    assert req.num_computed_tokens == item.start + 1 + accepted == req.num_tokens - 1
    assert len(buffers.block_table("1")) == cdiv(6 + 4, 4)  # pages of rejected positions stay
    with pytest.raises(ValueError, match="accepted"):
        sched.accept_spec_tokens(item, 4)


def test_accepting_on_a_finished_request_changes_nothing() -> None:
    sched, _ = make_scheduler()
    req = decoding(sched, "1")
    req.spec_token_ids = [5, 6]
    out = sched.schedule()
    sched.update_after_step(out)
    sched.finish_request(req, RequestStatus.FINISHED_STOPPED)
    sched.accept_spec_tokens(out.scheduled[0], 2)
    assert req.num_computed_tokens == 7


# ------------------------------------------------------------------------------ sample_and_verify


def _one_hot(tokens: list[int]) -> torch.Tensor:
    logits = torch.zeros(len(tokens), VOCAB)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 10.0
    return logits


def _item(req: Request, spec: list[int]) -> ScheduledRequest:
    return ScheduledRequest(req, 1 + len(spec), start=req.num_tokens - 1, samples=True, spec_token_ids=spec)


def test_verify_accepts_up_to_the_first_mismatch_and_appends_the_bonus() -> None:
    reqs = [make_request(i, 3) for i in range(4)]
    items = [_item(reqs[0], [10, 11, 12]), _item(reqs[1], [20, 21]), _item(reqs[2], []), _item(reqs[3], [40])]
    rows = [10, 11, 12, 13] + [20, 99, 22] + [30] + [41, 42]
    appended: list[tuple[str, int]] = []

    def append(request: Request, token: int, logprobs: object) -> bool:
        appended.append((request.request_id, token))
        request.append_output_token(token)
        return True

    accepted = sample_and_verify(Sampler(), _one_hot(rows), items, append)
    assert accepted == [3, 1, 0, 0]
    assert [r.output_token_ids for r in reqs] == [[10, 11, 12, 13], [20, 99], [30], [41]]
    # Round by round: the first row of every request, then the second of those still matching, ...
    assert appended == [
        ("0", 10),
        ("1", 20),
        ("2", 30),
        ("3", 41),
        ("0", 11),
        ("1", 99),
        ("0", 12),
        ("0", 13),
    ]


def test_verify_stops_where_the_request_finishes() -> None:
    req = make_request(0, 3)

    def append(request: Request, token: int, logprobs: object) -> bool:
        request.append_output_token(token)
        return token != STOP

    accepted = sample_and_verify(
        Sampler(), _one_hot([10, STOP, 12, 13]), [_item(req, [10, STOP, 12])], append
    )
    assert accepted == [2] and req.output_token_ids == [10, STOP]


class CountingSampler(Sampler):
    """The real sampler, counting its calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[int] = []

    def __call__(self, logits, requests):
        self.calls.append(logits.shape[0])
        return super().__call__(logits, requests)


def _appending(request: Request, token: int, logprobs: object) -> bool:
    request.append_output_token(token)
    return True


def test_independent_rows_are_read_from_the_device_once() -> None:
    """Greedy rows without penalties: one sampler call over every row, the same tokens and acceptance as
    the rounds (the first test's case)."""
    reqs = [make_request(i, 3) for i in range(4)]
    items = [_item(reqs[0], [10, 11, 12]), _item(reqs[1], [20, 21]), _item(reqs[2], []), _item(reqs[3], [40])]
    sampler = CountingSampler()
    accepted = sample_and_verify(
        sampler, _one_hot([10, 11, 12, 13, 20, 99, 22, 30, 41, 42]), items, _appending
    )
    assert accepted == [3, 1, 0, 0] and sampler.calls == [10]
    assert [r.output_token_ids for r in reqs] == [[10, 11, 12, 13], [20, 99], [30], [41]]


def test_penalized_rows_are_sampled_round_by_round() -> None:
    """A repetition penalty sees the tokens appended before each row: row 1's top token (the draft, also
    row 0's token) is penalised below its runner-up, so the draft after it is rejected, as it would be one
    token at a time. Rounds: one sampler call a row."""
    req = Request("0", [1, 2, 3], SamplingParams(max_tokens=8, temperature=0.0, repetition_penalty=4.0))
    logits = torch.zeros(3, VOCAB)
    logits[0, 10] = 10.0
    logits[1, 10], logits[1, 11] = 2.0, 1.0  # after the penalty on 10: 0.5 < 1.0
    logits[2, 12] = 10.0
    sampler = CountingSampler()
    accepted = sample_and_verify(sampler, logits, [_item(req, [10, 10])], _appending)
    assert req.output_token_ids == [10, 11] and accepted == [1]
    assert sampler.calls == [1, 1]


def test_verify_checks_the_row_count() -> None:
    req = make_request(0, 3)
    with pytest.raises(ValueError, match="logits rows"):
        sample_and_verify(Sampler(), _one_hot([1, 2]), [_item(req, [1, 2])], lambda *a: True)


# --------------------------------------------------------------------------- the simulated engine loop


class ScriptedDrafter(Executor):
    """``propose`` drafts the true continuation with probability ``p_right`` per token (a wrong token
    otherwise), after checking its inputs against the request's tokens and pages."""

    def __init__(self, requests: dict[str, Request], block_size: int, p_right: float, rng: random.Random):
        self.requests, self.block_size, self.p_right, self.rng = requests, block_size, p_right, rng
        self.calls: list[list[DraftInput]] = []

    def execute(self, batch: object) -> ExecutorOutput:
        raise NotImplementedError

    def propose(self, inputs: list[DraftInput]) -> list[list[int]]:
        self.calls.append(inputs)
        drafts = []
        for inp in inputs:
            req = self.requests[inp.request_id]
            n = len(inp.next_token_ids)
            assert req.all_token_ids[inp.start + 1 : inp.start + 1 + n] == inp.next_token_ids
            assert inp.start + n == req.num_computed_tokens  # exactly the positions computed and kept
            last = inp.start + n - 1 + max(inp.num_drafts - 1, 0)
            assert last // self.block_size < len(inp.block_table), "no page for a chained draft"
            out = []
            for j in range(inp.num_drafts):
                right = target(req, req.num_tokens + j)
                out.append(right if self.rng.random() < self.p_right else (right + 1) % VOCAB)
            drafts.append(out)
        return drafts


def run(
    prompts: list[tuple[int, int]],
    *,
    num_spec: int,
    p_right: float,
    seed: int = 0,
    num_blocks: int = 256,
    block_size: int = 4,
    **config: object,
) -> tuple[list[Request], dict[str, int], int]:
    """Run requests (prompt length, max_tokens) to the end; returns them, the stats and the step count."""
    sched, buffers = make_scheduler(num_blocks=num_blocks, block_size=block_size, **config)
    reqs = [make_request(i, n, max_tokens=m) for i, (n, m) in enumerate(prompts)]
    drafter = ScriptedDrafter({r.request_id: r for r in reqs}, block_size, p_right, random.Random(seed))
    spec = SpeculativeDecoder(num_spec, drafter, buffers, sched, max_model_len=10_000) if num_spec else None
    stats = {"spec_draft_tokens": 0, "spec_accepted_tokens": 0}
    sampler = Sampler()
    for r in reqs:
        sched.add_request(r)

    def append(request: Request, token: int, logprobs: object) -> bool:
        request.append_output_token(token)
        if token == STOP:
            sched.finish_request(request, RequestStatus.FINISHED_STOPPED)
        elif request.num_output_tokens >= request.sampling_params.max_tokens:
            sched.finish_request(request, RequestStatus.FINISHED_LENGTH)
        return not request.is_finished

    steps = 0
    while sched.has_unfinished_requests():
        steps += 1
        assert steps < 5000, "no progress"
        out = sched.schedule()
        assert out.num_batched_tokens <= sched.config.max_num_batched_tokens
        for item in out.scheduled:
            req = item.request
            assert len(item.spec_token_ids) <= num_spec
            assert item.start + item.num_new_tokens <= req.num_tokens_with_spec
            assert len(buffers.block_table(req.request_id)) * block_size >= item.start + item.num_new_tokens
            if item.spec_token_ids:
                assert item.samples and item.start == req.num_tokens - 1
        buffers.check_invariants()
        sched.update_after_step(out)
        items = [item for item in out.scheduled if item.samples]
        rows = [
            target(i.request, i.start + i.num_new_tokens - len(i.spec_token_ids) + j)
            for i in items
            for j in range(1 + len(i.spec_token_ids))
        ]
        accepted = sample_and_verify(sampler, _one_hot(rows), items, append) if items else []
        if spec is not None:
            spec.after_step(out, items, accepted, stats)
        for req in sched.running:
            assert req.num_computed_tokens <= req.num_tokens - 1
            assert len(req.spec_token_ids) <= num_spec
        buffers.check_invariants()
    assert buffers.pool.num_free == buffers.pool.num_blocks
    return reqs, stats, steps


def expected_output(req: Request) -> list[int]:
    out = []
    for j in range(req.sampling_params.max_tokens):
        out.append(target(req, req.num_prompt_tokens + j))
        if out[-1] == STOP:
            break
    return out


PROMPTS = [(5, 12), (17, 9), (3, 20), (30, 6), (1, 15), (11, 1)]


@pytest.mark.parametrize("num_spec", [1, 2, 4])
def test_right_drafts_cut_the_steps_and_keep_the_output(num_spec: int) -> None:
    base, _, base_steps = run(PROMPTS, num_spec=0, p_right=0)
    reqs, stats, steps = run(PROMPTS, num_spec=num_spec, p_right=1.0)
    assert [r.output_token_ids for r in reqs] == [r.output_token_ids for r in base]
    assert [r.output_token_ids for r in reqs] == [expected_output(r) for r in reqs]
    assert 0 < stats["spec_accepted_tokens"] <= stats["spec_draft_tokens"]
    # Every draft is accepted, except those after a stop token (verification ends there).
    assert any(r.status is RequestStatus.FINISHED_STOPPED for r in reqs)
    for r in reqs:
        if r.status is RequestStatus.FINISHED_LENGTH:
            assert r.num_accepted_tokens == r.num_draft_tokens
    assert steps < base_steps
    # Each decode step emits 1 + num_spec tokens while a request has that many left.
    longest = max(m for _, m in PROMPTS)
    assert steps <= 1 + cdiv(longest - 1, 1 + num_spec)


def test_wrong_drafts_are_all_rolled_back() -> None:
    base, _, base_steps = run(PROMPTS, num_spec=0, p_right=0)
    reqs, stats, steps = run(PROMPTS, num_spec=3, p_right=0.0)
    assert [r.output_token_ids for r in reqs] == [r.output_token_ids for r in base]
    assert stats["spec_accepted_tokens"] == 0 and stats["spec_draft_tokens"] > 0
    assert steps == base_steps


def test_drafts_respect_max_tokens() -> None:
    """No request is given more drafts than it can still emit minus the bonus token."""
    reqs, stats, _ = run([(4, 3), (4, 1)], num_spec=4, p_right=1.0)
    assert [r.num_output_tokens for r in reqs] == [3, 1]
    # Request 0: first token from the prefill, then 1 draft + bonus; request 1 never drafts.
    assert stats["spec_draft_tokens"] == 1 and reqs[1].num_draft_tokens == 0


def test_sampled_requests_do_not_draft() -> None:
    sched, buffers = make_scheduler()
    req = make_request(0, 4, temperature=0.8)
    sched.add_request(req)
    drafter = ScriptedDrafter({"0": req}, 4, 1.0, random.Random(0))
    spec = SpeculativeDecoder(2, drafter, buffers, sched, max_model_len=100)
    out = sched.schedule()
    sched.update_after_step(out)
    req.append_output_token(1)
    spec.after_step(out, list(out.scheduled), [0], {"spec_draft_tokens": 0, "spec_accepted_tokens": 0})
    assert drafter.calls == [] and req.spec_token_ids == []


@st.composite
def scenarios(draw: st.DrawFn) -> dict:
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    prompts = draw(st.lists(st.tuples(st.integers(1, 24), st.integers(1, 16)), min_size=1, max_size=6))
    longest = max(n + m for n, m in prompts)
    return {
        "prompts": prompts,
        "num_spec": draw(st.integers(1, 4)),
        "p_right": draw(st.sampled_from([0.0, 0.5, 0.9, 1.0])),
        "seed": draw(st.integers(0, 100)),
        "block_size": block_size,
        # From one request's worth of pages (with its drafts) upwards: small pools preempt.
        "num_blocks": draw(st.integers(cdiv(longest + 4, block_size) + 1, 4 * cdiv(longest + 4, block_size))),
        "max_num_batched_tokens": draw(st.integers(1, 40)),
        "max_num_seqs": draw(st.integers(1, 6)),
        "long_prefill_token_threshold": draw(st.sampled_from([None, 3, 8])),
    }


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_random_drafts_keep_invariants_and_the_output(scenario: dict) -> None:
    """Any mix of right and wrong drafts, budgets, chunking and preemption: pages stay consistent, every
    running request's computed count stays below its token count, and the output is the draft-free one."""
    reqs, stats, _ = run(
        scenario["prompts"],
        num_spec=scenario["num_spec"],
        p_right=scenario["p_right"],
        seed=scenario["seed"],
        num_blocks=scenario["num_blocks"],
        block_size=scenario["block_size"],
        max_num_batched_tokens=scenario["max_num_batched_tokens"],
        max_num_seqs=scenario["max_num_seqs"],
        long_prefill_token_threshold=scenario["long_prefill_token_threshold"],
    )
    assert [r.output_token_ids for r in reqs] == [expected_output(r) for r in reqs]
    assert 0 <= stats["spec_accepted_tokens"] <= stats["spec_draft_tokens"]
    if any(r.num_preemptions for r in reqs):
        event("preempted")
    if stats["spec_accepted_tokens"]:
        event("drafts accepted")
    if scenario["p_right"] == 0.0:
        assert stats["spec_accepted_tokens"] == 0


# ------------------------------------------------------------------------------------ model capability


class _Model:
    def __init__(self, num_mtp_layers: int, recurrent: bool = False, snapshots: int = 0) -> None:
        self.num_mtp_layers = num_mtp_layers
        self.recurrent = recurrent
        self.snapshot_inside_chunk_tokens = snapshots

    def buffer_specs(self) -> list:
        state = RecurrentStateSpec(0, (("s", (2,)),), torch.float32)
        return [*SPECS, state] if self.recurrent else list(SPECS)

    def mtp_buffer_specs(self) -> list:
        return [
            PagedKVSpec(layer_index=9 + i, num_kv_heads=1, head_dim=1, dtype=torch.float32) for i in range(2)
        ]


def test_paged_specs_need_a_drafting_model_that_can_roll_its_state_back() -> None:
    mtp, ngram = SpeculativeConfig(num_tokens=3), SpeculativeConfig(num_tokens=3, method="ngram")
    assert draft_buffer_specs(_Model(0), 0) == []
    assert paged_buffer_specs(_Model(0), SpeculativeConfig()) == list(SPECS)
    assert [s.layer_index for s in paged_buffer_specs(_Model(2), mtp)][len(SPECS) :] == [
        9
    ]  # the one that runs
    with pytest.raises(
        ConfigError, match=r"speculative\.num_tokens=3 needs a model with draft \(MTP\) layers.*method=ngram"
    ):
        paged_buffer_specs(_Model(0), mtp)
    # Prompt lookup drafts for any model, and adds no cache.
    assert paged_buffer_specs(_Model(0), ngram) == list(SPECS)
    for config in (mtp, ngram):
        with pytest.raises(
            ConfigError, match="recurrent state but its forward saves no state inside a chunk"
        ):
            paged_buffer_specs(_Model(1, recurrent=True), config)
    # A model that saves its state inside a chunk drafts: rejected drafts roll back from those saves.
    assert [s.layer_index for s in draft_buffer_specs(_Model(1, recurrent=True, snapshots=128), 2)] == [9]
