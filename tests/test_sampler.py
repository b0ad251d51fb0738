"""The sampler: greedy, the exact sampling distribution, seeds, penalties and logprobs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pegainfer.engine.outputs import Logprob
from pegainfer.engine.request import Request
from pegainfer.errors import RequestError
from pegainfer.sampling.sampler import (
    HostBuffers,
    HostCopy,
    Sampler,
    apply_penalties,
    compute_prompt_logprobs,
)
from pegainfer.sampling.sampling_params import SamplingParams

# Distinct values, so no filter boundary is a tie; every token keeps an expected count well above 5.
TINY_LOGITS = [1.6, 1.2, 0.9, 0.5, 0.1, -0.3, -0.8, -1.2]


def make_request(
    rid: object = 0, prompt: list[int] | None = None, output: list[int] | None = None, **params: object
) -> Request:
    req = Request(str(rid), [0] if prompt is None else prompt, SamplingParams(**params))
    for token in output or []:
        req.append_output_token(token)
    return req


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X ~ chi-square(df), from the closed forms of the upper incomplete gamma function."""
    y = x / 2
    if df % 2 == 0:
        term = total = math.exp(-y)
        for i in range(1, df // 2):
            term *= y / i
            total += term
        return total
    total = math.erfc(math.sqrt(y))
    term = math.exp(-y) * math.sqrt(y) / math.gamma(1.5)
    for i in range((df - 1) // 2):
        total += term
        term *= y / (i + 1.5)
    return total


def expected_distribution(
    logits: list[float], temperature: float = 1.0, top_k: int = -1, top_p: float = 1.0, min_p: float = 0.0
) -> np.ndarray:
    """The sampling distribution straight from the definitions, each filter renormalizing what it keeps."""
    x = np.asarray(logits, dtype=np.float64) / temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    if top_k > 0:
        keep = np.zeros_like(p, dtype=bool)
        keep[np.argsort(-p)[:top_k]] = True
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    if top_p < 1.0:
        keep = np.zeros_like(p, dtype=bool)
        mass = 0.0
        for token in np.argsort(-p):
            keep[token] = True
            mass += p[token]
            if mass >= top_p:
                break
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    if min_p > 0.0:
        p = np.where(p >= min_p * p.max(), p, 0.0)
        p /= p.sum()
    return p


def assert_matches_distribution(tokens: list[int], expected: np.ndarray) -> None:
    counts = np.bincount(np.asarray(tokens), minlength=len(expected))
    assert counts[expected == 0].sum() == 0, f"filtered-out tokens were sampled: {counts}"
    support = expected > 0
    exp_counts = expected[support] * len(tokens)
    stat = float(((counts[support] - exp_counts) ** 2 / exp_counts).sum())
    df = int(support.sum()) - 1
    if df > 0:
        p_value = chi2_sf(stat, df)
        assert p_value > 1e-4, (
            f"chi2={stat:.1f} df={df} p={p_value:.2e} counts={counts} expected={exp_counts}"
        )


def test_chi2_sf_matches_known_critical_values() -> None:
    for df, x in [(1, 3.841), (2, 5.991), (3, 7.815), (4, 9.488), (7, 14.067)]:
        assert chi2_sf(x, df) == pytest.approx(0.05, abs=2e-4)


def test_greedy_is_argmax_and_ignores_filters() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=gen)
    requests = [
        make_request(0, temperature=0.0),
        make_request(1, temperature=0.0, top_k=3, top_p=0.1, min_p=0.9),
        make_request(2, temperature=0.0, seed=5),
        make_request(3, temperature=0.0, logprobs=2),
        make_request(4, temperature=0.0),
        make_request(5, temperature=0.0, top_k=1),
    ]
    out = Sampler(seed=1)(logits, requests)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert Sampler(seed=2)(logits, requests).token_ids == out.token_ids


def test_greedy_on_half_precision_logits() -> None:
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    requests = [make_request(i, temperature=0.0) for i in range(4)]
    assert Sampler()(logits, requests).token_ids == logits.float().argmax(dim=-1).tolist()


def test_logits_are_not_modified() -> None:
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(4))
    before = logits.clone()
    requests = [
        make_request(0, output=[1, 2], repetition_penalty=1.5, frequency_penalty=0.5, top_k=5),
        make_request(1, min_tokens=3, eos_token_ids=(7,), temperature=0.5, min_p=0.1),
        make_request(2, temperature=0.0, presence_penalty=1.0, output=[3]),
    ]
    Sampler()(logits, requests)
    assert torch.equal(logits, before)


SINGLE_CONFIGS = [
    {"temperature": 0.7},
    {"temperature": 1.5},
    {"top_k": 3},
    {"top_p": 0.8},
    {"min_p": 0.2},
    {"temperature": 0.8, "top_k": 6, "top_p": 0.85, "min_p": 0.3},
]


@pytest.mark.parametrize("config", SINGLE_CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_sampling_matches_exact_distribution(config: dict[str, float]) -> None:
    # 50k draws: enough to tell temperature 0.7 from 0.73 at this threshold.
    n = 50_000
    params = SamplingParams(**config)
    requests = [Request(str(i), [0], params) for i in range(n)]
    logits = torch.tensor(TINY_LOGITS).expand(n, -1)
    tokens = Sampler(seed=1234)(logits, requests).token_ids
    assert_matches_distribution(tokens, expected_distribution(TINY_LOGITS, **config))


def test_mixed_batch_samples_each_row_from_its_own_distribution() -> None:
    configs = [{"top_k": 3}, {"top_p": 0.8, "temperature": 1.5}, {"min_p": 0.2}, {"temperature": 0.0}]
    per_config = 8_000
    params = [SamplingParams(**c) for c in configs]
    # Interleaved, so every filter works on a strict subset of the rows.
    requests = [Request(str(i), [0], params[i % len(params)]) for i in range(per_config * len(params))]
    logits = torch.tensor(TINY_LOGITS).expand(len(requests), -1)
    tokens = Sampler(seed=99)(logits, requests).token_ids
    for c, config in enumerate(configs[:-1]):
        assert_matches_distribution(tokens[c :: len(configs)], expected_distribution(TINY_LOGITS, **config))
    assert set(tokens[len(configs) - 1 :: len(configs)]) == {0}


def test_seeded_request_is_independent_of_its_batch() -> None:
    vocab, steps = 64, 6
    step_logits = torch.randn(steps, vocab, generator=torch.Generator().manual_seed(11))
    seeded = {"seed": 7, "temperature": 0.9, "top_p": 0.95}

    def run_alone(sampler_seed: int) -> list[int]:
        req = make_request("alone", **seeded)
        sampler = Sampler(seed=sampler_seed)
        for step in range(steps):
            req.append_output_token(sampler(step_logits[step : step + 1], [req]).token_ids[0])
        return req.output_token_ids

    alone = run_alone(0)
    assert run_alone(123) == alone

    target = make_request("target", **seeded)
    twin = make_request("twin", **seeded)
    others = [
        make_request("other-seeded", seed=8, temperature=1.2, top_k=10),
        make_request("unseeded", temperature=1.0),
        make_request("greedy", temperature=0.0),
        make_request("penalized", temperature=0.7, repetition_penalty=1.3, min_p=0.05),
    ]
    sampler = Sampler(seed=5)
    noise_gen = torch.Generator().manual_seed(12)
    for step in range(steps):
        batch = others[step % len(others) :] + [target] + others[: step % len(others)] + [twin]
        logits = torch.randn(len(batch), vocab, generator=noise_gen)
        logits[batch.index(target)] = step_logits[step]
        logits[batch.index(twin)] = step_logits[step]
        out = sampler(logits, batch)
        for req, token in zip(batch, out.token_ids, strict=True):
            req.append_output_token(token)
    assert target.output_token_ids == alone
    assert twin.output_token_ids == alone


def test_different_seeds_give_different_sequences() -> None:
    logits = torch.zeros(1, 1000)
    first = Sampler()(logits, [make_request(seed=1)]).token_ids
    second = Sampler()(logits, [make_request(seed=2)]).token_ids
    assert first != second


def reference_penalties(
    logits: list[float], prompt: list[int], output: list[int], params: SamplingParams
) -> list[float]:
    """Penalties applied token by token, as the definitions read."""
    result = list(logits)
    for token in set(prompt) | set(output):
        if result[token] > 0:
            result[token] /= params.repetition_penalty
        else:
            result[token] *= params.repetition_penalty
    for token in set(output):
        result[token] -= params.frequency_penalty * output.count(token) + params.presence_penalty
    return result


def test_penalties_match_hand_computation() -> None:
    logits = torch.tensor([[1.0, -1.0, 2.0, -2.0, 0.5, 0.0]])
    req = make_request(
        prompt=[0, 1], output=[2, 2, 3], repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25
    )
    # 0, 1 (prompt) and 2, 3 (output) are repetition-penalized; 2 (twice) and 3 (once) pay the others.
    expected = [0.5, -2.0, 1.0 - 2 * 0.5 - 0.25, -4.0 - 0.5 - 0.25, 0.5, 0.0]
    assert apply_penalties(logits, [req])[0].tolist() == pytest.approx(expected)


def test_frequency_and_presence_ignore_the_prompt() -> None:
    logits = torch.tensor([[1.0, 1.0, 3.0, 1.0]])
    req = make_request(
        prompt=[0, 2], output=[1, 1], frequency_penalty=1.0, presence_penalty=0.5, temperature=0
    )
    assert apply_penalties(logits, [req])[0].tolist() == pytest.approx([1.0, -1.5, 3.0, 1.0])


def test_batched_penalties_match_reference() -> None:
    vocab = 30
    rng = np.random.default_rng(0)
    logits = torch.randn(7, vocab, generator=torch.Generator().manual_seed(6))
    param_sets = [
        {"repetition_penalty": 1.7},
        {"frequency_penalty": 0.4, "presence_penalty": -0.3},
        {},
        {"repetition_penalty": 0.8, "frequency_penalty": -1.0, "presence_penalty": 2.0},
        {"presence_penalty": 1.0},
        {},
        {"repetition_penalty": 1.2, "frequency_penalty": 0.1},
    ]
    requests = []
    for i, p in enumerate(param_sets):
        prompt = rng.integers(0, vocab, size=int(rng.integers(1, 12))).tolist()
        output = rng.integers(0, vocab, size=int(rng.integers(0, 9))).tolist()
        requests.append(make_request(i, prompt=prompt, output=output, **p))
    got = apply_penalties(logits, requests)
    for i, req in enumerate(requests):
        want = reference_penalties(
            logits[i].tolist(), req.prompt_token_ids, req.output_token_ids, req.sampling_params
        )
        assert got[i].tolist() == pytest.approx(want, abs=1e-6), f"row {i}"


def test_penalties_steer_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.0, 0.0]])
    plain = make_request(output=[0], temperature=0.0)
    penalized = make_request(output=[0], temperature=0.0, repetition_penalty=2.0)
    assert Sampler()(logits.expand(2, -1), [plain, penalized]).token_ids == [0, 1]


def test_min_tokens_bans_eos_and_stop_ids_until_reached() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 5.0, 3.0, 4.0]])
    params = {"temperature": 0.0, "min_tokens": 2, "eos_token_ids": (3,), "stop_token_ids": [5]}
    sampler = Sampler()
    assert sampler(logits, [make_request(**params)]).token_ids == [4]
    assert sampler(logits, [make_request(output=[1], **params)]).token_ids == [4]
    assert sampler(logits, [make_request(output=[1, 1], **params)]).token_ids == [3]
    # ignore_eos lifts the eos ban, not the stop_token_ids one.
    ignoring = make_request(output=[1], ignore_eos=True, **params)
    assert sampler(logits, [ignoring]).token_ids == [3]
    assert apply_penalties(logits, [ignoring])[0, 5] == float("-inf")


def test_logit_bias_steers_greedy_and_random_rows_and_leaves_logprobs_raw() -> None:
    """OpenAI's logit_bias: added to the logits before penalties and draws (+100 picks a token, -100
    bans one in practice); a min_tokens ban still wins over a bias; logprobs describe the model."""
    logits = torch.tensor([[3.0, 2.0, 0.0, 1.0]])
    sampler = Sampler(seed=1)
    rows = [
        make_request(temperature=0.0),
        make_request(temperature=0.0, logit_bias={2: 100.0}),
        make_request(temperature=0.0, logit_bias={0: -100.0, 3: 1.5}),
        make_request(temperature=1.0, logit_bias={1: 100.0}, logprobs=1),
    ]
    out = sampler(logits.expand(4, -1), rows)
    assert out.token_ids == [0, 2, 3, 1]
    assert out.logprobs[3][1].logprob == pytest.approx(torch.log_softmax(logits[0], -1)[1].item())
    banned = make_request(temperature=0.0, min_tokens=1, eos_token_ids=(2,), logit_bias={2: 100.0})
    assert sampler(logits, [banned]).token_ids == [0]
    n = 500
    drawn = Sampler(seed=3)(logits.expand(n, -1), [make_request(i, logit_bias={0: -100.0}) for i in range(n)])
    assert 0 not in drawn.token_ids


def test_logit_bias_must_be_token_ids_with_values_in_range() -> None:
    for bad in ({-1: 1.0}, {"5": 1.0}, {5: 101.0}, {5: float("nan")}, {True: 1.0}):
        with pytest.raises(RequestError, match="logit_bias"):
            SamplingParams(logit_bias=bad)


def test_allowed_token_ids_limit_greedy_and_random_rows() -> None:
    """Only the listed tokens are drawn, greedy or sampled, rows beside unlimited ones; where min_tokens
    bans every allowed token (a label list of EOS alone) the list wins rather than leaving nothing."""
    logits = torch.tensor([TINY_LOGITS])
    sampler = Sampler(seed=4)
    rows = [make_request(0, temperature=0.0), make_request(1, temperature=0.0, allowed_token_ids=[5, 3])]
    assert sampler(logits.expand(2, -1), rows).token_ids == [0, 3]
    n = 1000
    drawn = Sampler(seed=5)(
        logits.expand(n, -1), [make_request(i, temperature=1.0, allowed_token_ids=[2, 6]) for i in range(n)]
    ).token_ids
    assert set(drawn) == {2, 6}
    stuck = make_request(2, temperature=0.0, min_tokens=3, eos_token_ids=(4,), allowed_token_ids=[4])
    assert sampler(logits, [stuck]).token_ids == [4]
    for bad in ([], [-1], [True]):
        with pytest.raises(RequestError, match="allowed_token_ids"):
            SamplingParams(allowed_token_ids=bad)


def test_min_tokens_never_samples_banned_ids() -> None:
    n = 2000
    params = SamplingParams(temperature=1.0, min_tokens=1, eos_token_ids=(0, 1))
    requests = [Request(str(i), [0], params) for i in range(n)]
    tokens = Sampler()(torch.tensor(TINY_LOGITS).expand(n, -1), requests).token_ids
    assert not {0, 1} & set(tokens)


def test_logprobs_are_raw_log_softmax_with_ranks() -> None:
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(8))
    raw = torch.log_softmax(logits, dim=-1)
    requests = [
        make_request(0, logprobs=3, temperature=1.0, repetition_penalty=3.0, prompt=list(range(10))),
        make_request(1, temperature=0.0),
        make_request(2, logprobs=5, temperature=0.0, frequency_penalty=2.0, output=[0, 1]),
    ]
    out = Sampler()(logits, requests)
    assert out.logprobs[1] is None
    for row, k in [(0, 3), (2, 5)]:
        entry = out.logprobs[row]
        assert entry is not None
        top = torch.topk(raw[row], k)
        for rank, (value, token) in enumerate(zip(top.values.tolist(), top.indices.tolist(), strict=True), 1):
            assert entry[token].rank == rank
            assert entry[token].logprob == pytest.approx(value, abs=1e-5)
        chosen = out.token_ids[row]
        assert entry[chosen].logprob == pytest.approx(raw[row, chosen].item(), abs=1e-5)
        assert entry[chosen].rank == int((raw[row] > raw[row, chosen]).sum()) + 1
        assert len(entry) in (k, k + 1)


def test_chosen_token_outside_top_k_is_included_with_its_rank() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 5.0, 3.0]])
    raw = torch.log_softmax(logits, dim=-1)[0]
    banned = {"temperature": 0.0, "min_tokens": 1, "eos_token_ids": (3,)}
    sampler = Sampler()
    only_chosen = sampler(logits, [make_request(logprobs=0, **banned)]).logprobs[0]
    assert only_chosen == {4: Logprob(logprob=pytest.approx(raw[4].item()), rank=2)}
    with_top = sampler(logits, [make_request(logprobs=1, **banned)]).logprobs[0]
    assert with_top is not None
    assert list(with_top) == [4, 3]
    assert (with_top[3].rank, with_top[4].rank) == (1, 2)
    assert with_top[3].logprob == pytest.approx(raw[3].item())


def test_prompt_logprobs() -> None:
    logits = torch.randn(5, 12, generator=torch.Generator().manual_seed(9))
    targets = [3, 0, 11, 7, 3]
    raw = torch.log_softmax(logits, dim=-1)
    result = compute_prompt_logprobs(logits, targets, 2)
    assert len(result) == len(targets)
    for t, (entry, target) in enumerate(zip(result, targets, strict=True)):
        assert entry[target].logprob == pytest.approx(raw[t, target].item(), abs=1e-5)
        assert entry[target].rank == int((raw[t] > raw[t, target]).sum()) + 1
        top = torch.topk(raw[t], 2).indices.tolist()
        assert [entry[tok].rank for tok in top] == [1, 2]
        assert set(entry) == {target, *top}
    assert compute_prompt_logprobs(logits, targets, 0)[2] == {11: result[2][11]}
    with pytest.raises(ValueError):
        compute_prompt_logprobs(logits, targets[:-1], 2)


def test_incremental_penalty_counts_equal_a_fresh_count() -> None:
    """Penalty statistics are updated with only the new tokens each step; they must equal a recount."""
    params = SamplingParams(
        repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2, max_tokens=50
    )
    live = Request("live", [1, 2, 3, 3], params)
    gen = torch.Generator().manual_seed(0)
    for step in range(6):
        logits = torch.randn(1, 16, generator=gen)
        fresh = Request("fresh", live.prompt_token_ids, params)
        for token in live.output_token_ids:
            fresh.append_output_token(token)
        assert torch.equal(apply_penalties(logits, [live]), apply_penalties(logits, [fresh]))
        for token in [step % 5, 7][: 1 + step % 2]:
            live.append_output_token(token)


def test_precomputed_greedy_tokens_are_taken_as_they_are() -> None:
    """With the decode graph's argmax given, an all-greedy batch takes it (no argmax here: a marker value
    proves it); a mixed batch draws its random rows into a copy (the given tokens are the executor's, an
    inference tensor: writing into them outside inference mode would fail); penalties (which move the
    argmax) ignore it."""
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0]])
    sampler = Sampler(seed=0)
    with torch.inference_mode():
        marker = torch.tensor([2, 2])  # not the argmax of either row
    greedy = [make_request(0, temperature=0), make_request(1, temperature=0)]
    out = sampler.sample(logits, greedy, marker)
    assert out.tokens is marker and out.result().token_ids == [2, 2]
    mixed = [make_request(0, temperature=0), make_request(1, temperature=1.0, top_k=1)]
    out = sampler.sample(logits, mixed, marker)
    assert out.result().token_ids == [2, 0] and marker.tolist() == [2, 2]  # row 1 drew its top-1 token
    penalized = [make_request(0, temperature=0, repetition_penalty=1.5), make_request(1, temperature=0)]
    assert sampler.sample(logits, penalized, marker).result().token_ids == [1, 0]


def test_results_read_twice_and_cpu_copies_pool_nothing() -> None:
    """result() may be called again (same output); CPU tensors are plain copies, nothing pooled."""
    buffers = HostBuffers()
    copy = HostCopy({"chosen": torch.tensor([1, 2])}, buffers)
    assert copy.wait()["chosen"].tolist() == [1, 2]
    copy.release()
    assert not buffers._free
    sample = Sampler(seed=0).sample(torch.tensor([[0.0, 1.0]]), [make_request(0, temperature=0)])
    assert sample.result() is sample.result() and sample.result().token_ids == [1]


@pytest.mark.gpu
def test_pinned_buffers_are_reused_only_after_their_result_is_read() -> None:
    """Pinned buffers (and events) of a copy go back to the pool once read and released, so a later copy
    reuses them; a copy still unread keeps its own."""
    buffers = HostBuffers()
    a = HostCopy({"chosen": torch.tensor([1, 2], device="cuda")}, buffers)
    b = HostCopy({"chosen": torch.tensor([3, 4], device="cuda")}, buffers)  # a not read yet: its own
    assert a.host["chosen"].data_ptr() != b.host["chosen"].data_ptr()
    pinned = a.host["chosen"].data_ptr()
    assert a.wait()["chosen"].tolist() == [1, 2]
    a.release()
    c = HostCopy({"chosen": torch.tensor([5, 6], device="cuda")}, buffers)
    assert c.host["chosen"].data_ptr() == pinned
    assert b.wait()["chosen"].tolist() == [3, 4] and c.wait()["chosen"].tolist() == [5, 6]


def test_a_repeated_batch_is_sampled_as_a_fresh_one() -> None:
    """The sampler reuses its scan of the rows when a call's requests are the last call's; any other
    batch (other requests, other order, the caller's list changed in place) is scanned anew: every call
    gives what a fresh sampler gives."""
    greedy = make_request("g", temperature=0)
    lp = make_request("l", temperature=0, logprobs=2)
    drawn = make_request("d", temperature=1.0, seed=7)
    banned = make_request("b", temperature=0, min_tokens=3, stop_token_ids=[0])
    logits = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    reused = Sampler(seed=1)
    requests = [greedy, lp, drawn]
    batches = [requests, requests, [drawn, lp, greedy], [greedy, lp, banned], [greedy, lp, banned]]
    for batch in batches:
        for r in (drawn, *batch):  # equal draws: the seeded row's generator starts over each call
            r.generator = None
        got = reused.sample(logits, batch).result()
        for r in batch:
            r.generator = None
        want = Sampler(seed=1).sample(logits, batch).result()
        assert got.token_ids == want.token_ids and got.logprobs == want.logprobs
    reused.sample(logits, requests).result()
    requests[2] = banned  # the same list object, now other requests
    logits[2, 0] = 10.0  # the banned id would win
    got = reused.sample(logits, requests).result()
    assert got.token_ids[2] != 0  # the ban is applied: the scan was redone
    assert got.token_ids == Sampler(seed=1).sample(logits, requests).result().token_ids


def test_a_waiting_grammar_makes_rows_depend_on_the_tokens_before():
    """A grammar deferred until a token (``StructuredOutputsParams.after``) starts inside a verification
    only where that token is among the drafts: then (and once it has started) the rows are sampled round
    by round, not in one call."""
    sampler = Sampler(seed=0)
    plain, waiting = make_request(0, temperature=0.0), make_request(1, temperature=0.0)
    assert sampler.rows_independent([plain])
    waiting.deferred_grammar = (7, object())
    assert not sampler.rows_independent([plain, waiting])  # the drafts unknown: it may start
    assert sampler.rows_independent([plain, waiting], [[1, 2], [3, 4]])  # no draft is the awaited token
    assert not sampler.rows_independent([plain, waiting], [[1, 2], [3, 7]])
    waiting.grammar, waiting.deferred_grammar = object(), None  # started: the same list, a grammar row
    assert not sampler.rows_independent([plain, waiting], [[1, 2], [3, 4]])
