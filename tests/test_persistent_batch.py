"""PersistentDecodeBatch: last step's batch is moved on only in the steady state of async decoding."""

from __future__ import annotations

import pytest
import torch

from pegainfer.engine.persistent_batch import PersistentDecodeBatch
from pegainfer.engine.request import PENDING_TOKEN, Request
from pegainfer.executor.executor import ModelBatch, SequenceChunk
from pegainfer.sampling.sampling_params import SamplingParams
from pegainfer.scheduling.scheduler import ScheduledRequest


def _requests(n: int) -> list[Request]:
    return [Request(f"r{i}", [1, 2, 3], SamplingParams()) for i in range(n)]


def _plan(requests: list[Request], start: int) -> list[ScheduledRequest]:
    return [ScheduledRequest(r, 1, start + i, True) for i, r in enumerate(requests)]


def _batch(plan: list[ScheduledRequest], **chunk_fields: object) -> ModelBatch:
    chunks = [
        SequenceChunk(
            item.request.request_id,
            [PENDING_TOKEN],
            item.start,
            [7, 8],
            serial=item.request.serial,
            num_logits=1,
            carry_from=row,
        )
        for row, item in enumerate(plan)
    ]
    for chunk in chunks:
        for name, value in chunk_fields.items():
            setattr(chunk, name, value)
    return ModelBatch(chunks, carried_tokens=torch.zeros(len(chunks), dtype=torch.int64))


def test_the_same_requests_at_the_next_step_move_the_batch_on() -> None:
    requests = _requests(3)
    kept = PersistentDecodeBatch()
    batch = _batch(_plan(requests, 10))
    kept.remember(_plan(requests, 10), batch, step=5)
    carried = torch.ones(3, dtype=torch.int64)
    moved = kept.reuse(_plan(requests, 11), carried, step=6)
    assert moved is batch and moved.carried_tokens is carried
    assert [c.start for c in moved.chunks] == [11, 12, 13]
    assert kept.reuse(_plan(requests, 12), carried, step=7) is batch  # and on, step after step


@pytest.mark.parametrize(
    "change",
    ["other requests", "other order", "fewer requests", "a step skipped", "the same step again"],
)
def test_any_other_plan_or_step_is_built_anew(change: str) -> None:
    requests = _requests(3)
    kept = PersistentDecodeBatch()
    kept.remember(_plan(requests, 10), _batch(_plan(requests, 10)), step=5)
    step = {"a step skipped": 7, "the same step again": 5}.get(change, 6)
    planned = {
        "other requests": [requests[0], requests[1], _requests(1)[0]],
        "other order": [requests[1], requests[0], requests[2]],
        "fewer requests": requests[:2],
    }.get(change, requests)
    assert kept.reuse(_plan(planned, 11), torch.ones(3, dtype=torch.int64), step) is None


@pytest.mark.parametrize(
    "fields",
    [
        {"token_ids": [5], "carry_from": -1},  # a known token (the last step's tokens were read first)
        {"token_ids": [5, 6], "carry_from": -1},  # a prefill chunk
        {"num_logits": 0},
        {"all_logits": True},
        {"keep_hidden": True},
    ],
)
def test_a_batch_that_is_not_a_carried_decode_is_not_kept(fields: dict[str, object]) -> None:
    requests = _requests(2)
    kept = PersistentDecodeBatch()
    kept.remember(_plan(requests, 10), _batch(_plan(requests, 10)), step=5)
    kept.remember(_plan(requests, 11), _batch(_plan(requests, 11), **fields), step=6)  # forgets the first
    assert kept.reuse(_plan(requests, 12), torch.ones(2, dtype=torch.int64), step=7) is None


def test_rows_out_of_order_are_not_kept() -> None:
    requests = _requests(2)
    kept = PersistentDecodeBatch()
    batch = _batch(_plan(requests, 10))
    batch.chunks[0].carry_from, batch.chunks[1].carry_from = 1, 0
    kept.remember(_plan(requests, 10), batch, step=5)
    assert kept.reuse(_plan(requests, 11), torch.ones(2, dtype=torch.int64), step=6) is None
