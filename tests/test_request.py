"""Request: the stop conditions it derives from its sampling params, in the form the engine checks."""

from __future__ import annotations

import sys

from pegainfer.engine.request import Request
from pegainfer.sampling.sampling_params import RequestOutputKind, SamplingParams


def test_length_limit_is_max_tokens_or_the_model_context() -> None:
    prompt = [5, 6, 7]
    assert Request("a", prompt, SamplingParams(max_tokens=4)).max_num_tokens == 7
    assert Request("a", prompt, SamplingParams(max_tokens=4), max_model_len=6).max_num_tokens == 6
    assert Request("a", prompt, SamplingParams(max_tokens=None), max_model_len=9).max_num_tokens == 9
    assert Request("a", prompt, SamplingParams(max_tokens=None)).max_num_tokens == sys.maxsize


def test_min_tokens_and_stop_ids() -> None:
    prompt = [5, 6, 7]
    params = SamplingParams(min_tokens=2, stop_token_ids=[9], eos_token_ids=(1, 2))
    request = Request("a", prompt, params)
    assert request.min_num_tokens == 5
    assert request.stop_ids == {1, 2, 9}
    ignoring = Request(
        "b", prompt, SamplingParams(stop_token_ids=[9, 1], ignore_eos=True, eos_token_ids=(1, 2))
    )
    assert ignoring.min_num_tokens == 3
    assert ignoring.stop_ids == {1, 9}  # a stop token id stops even when it is an EOS id too


def test_reports_progress_unless_only_the_final_output_of_one_sequence() -> None:
    final_only = RequestOutputKind.FINAL_ONLY
    assert not Request("a", [1], SamplingParams(output_kind=final_only)).reports_progress
    assert Request("a", [1], SamplingParams(output_kind=final_only, n=2)).reports_progress
    assert Request("a", [1], SamplingParams(output_kind=RequestOutputKind.DELTA)).reports_progress
    assert Request("a", [1], SamplingParams(output_kind=RequestOutputKind.CUMULATIVE)).reports_progress
