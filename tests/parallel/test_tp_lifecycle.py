"""The tensor-parallel executor's life: its ranks start, fail, and end without leaving anything behind.

Two ranks on the CPU (gloo) over the tiny Qwen3: a rank that dies or raises fails the step with an
error naming it, within seconds, and every later call at once; shutdown and the death of the engine's
process end every worker; configuration errors come before any worker starts or weight is read.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from pegainfer import LLM, SamplingParams
from pegainfer.engine.request import Request
from pegainfer.errors import ConfigError, ExecutorError
from pegainfer.executor.model_batch import ModelBatch, SequenceChunk

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _tp_llm(folder: Path, **options) -> LLM:
    return LLM(
        str(folder),
        dtype="float32",
        device="cpu",
        cpu_kv_cache_bytes=4 << 20,
        tensor_parallel_size=2,
        **options,
    )


def _workers(llm: LLM) -> list[subprocess.Popen]:
    return llm.engine.executor._ranks.processes


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, ended but not yet reaped, counts as ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_gone(pids: list[int], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while any(_alive(pid) for pid in pids):
        assert time.monotonic() < deadline, f"workers {[p for p in pids if _alive(p)]} are still running"
        time.sleep(0.05)


def test_a_killed_rank_fails_the_step_then_every_call(tiny_qwen3):
    llm = _tp_llm(tiny_qwen3)
    try:
        assert llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=GREEDY, use_tqdm=False)
        worker = _workers(llm)[0]
        os.kill(worker.pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(ExecutorError, match="rank 1"):
            llm.generate(prompt_token_ids=[[4, 5, 6]], sampling_params=GREEDY, use_tqdm=False)
        assert time.monotonic() - started < 20
        started = time.monotonic()
        with pytest.raises(ExecutorError, match="rank 1"):
            llm.generate(prompt_token_ids=[[4, 5, 6]], sampling_params=GREEDY, use_tqdm=False)
        assert time.monotonic() - started < 1  # poisoned: no second wait
        assert llm.engine.buffers.usage() == 0.0  # the failed requests were aborted
    finally:
        llm.engine.shutdown()


def test_a_rank_that_raises_reports_its_own_error(tiny_qwen3):
    llm = _tp_llm(tiny_qwen3)
    try:
        llm.engine.executor._channel.send(("no-such-step",))  # the worker cannot run it and raises
        with pytest.raises(
            ExecutorError, match="rank 1 failed: ExecutorError: unknown step message 'no-such-step'"
        ):
            llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=GREEDY, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    _wait_gone([p.pid for p in _workers(llm)])


def test_shutdown_ends_the_workers_and_frees_the_channel(tiny_qwen3):
    llm = _tp_llm(tiny_qwen3)
    executor = llm.engine.executor
    pids = [p.pid for p in _workers(llm)]
    shm = Path("/dev/shm") / executor._channel.name
    assert all(_alive(pid) for pid in pids) and shm.exists()
    llm.engine.shutdown()
    llm.engine.shutdown()  # idempotent
    assert all(p.poll() == 0 for p in _workers(llm))  # a clean exit on the stop message
    assert not shm.exists()
    with pytest.raises(ExecutorError, match="shut down"):
        llm.generate(prompt_token_ids=[[1, 2]], sampling_params=GREEDY, use_tqdm=False)


def test_the_death_of_the_engine_process_ends_its_workers(tiny_qwen3, tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import time, torch
            torch.set_num_threads(1)
            from pegainfer import LLM
            llm = LLM({str(tiny_qwen3)!r}, device="cpu", cpu_kv_cache_bytes=4 << 20, tensor_parallel_size=2)
            print(*[p.pid for p in llm.engine.executor._ranks.processes], flush=True)
            time.sleep(600)
            """
        )
    )
    driver = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(pid) for pid in driver.stdout.readline().split()]
        assert pids and all(_alive(pid) for pid in pids)
        driver.kill()  # no clean-up code runs: the workers must notice on their own
        driver.wait(10)
        _wait_gone(pids)
    finally:
        driver.kill()


def test_a_head_count_the_ranks_do_not_divide_names_the_counts(tiny_checkpoint_factory):
    folder = tiny_checkpoint_factory("qwen3", num_attention_heads=6, num_key_value_heads=2, head_dim=8)
    with pytest.raises(
        ConfigError, match="num_attention_heads: 6 cannot be split evenly over tensor-parallel size 4"
    ):
        LLM(str(folder), device="cpu", cpu_kv_cache_bytes=4 << 20, tensor_parallel_size=4)


def test_more_ranks_than_gpus_is_refused_before_anything_starts(tiny_qwen3, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    started = []
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: started.append(a))
    with pytest.raises(ConfigError, match="tp=2 needs 2 CUDA devices on this host, but torch sees 1"):
        LLM(str(tiny_qwen3), device="cuda", tensor_parallel_size=2)
    assert not started


def test_a_backend_this_torch_lacks_is_refused(tiny_qwen3, monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_gloo_available", lambda: False)
    with pytest.raises(ConfigError, match="needs gloo"):
        _tp_llm(tiny_qwen3)


def test_ranks_keep_their_own_block_tables_between_steps(tiny_qwen3):
    """Only the block-table entries a rank lacks travel: a request skipped for a step is sent whole again,
    and a table that grows sends its new pages only (the ranks' outputs stay equal to one rank's)."""
    one = LLM(str(tiny_qwen3), dtype="float32", device="cpu", cpu_kv_cache_bytes=4 << 20)
    llm = _tp_llm(tiny_qwen3)
    sent: list[tuple] = []
    channel = llm.engine.executor._channel
    send = channel.send
    channel.send = lambda message: (sent.append(message), send(message))[1]
    try:
        results = []
        for engine in (one.engine, llm.engine):
            request = Request("r", list(range(1, 20)), GREEDY)
            other = Request("o", list(range(30, 36)), GREEDY)
            buffers = engine.buffers
            assert buffers.allocate_slots(request, 19) and buffers.allocate_slots(other, 6)

            def chunk(req, start, n, buffers=buffers):
                ids = req.prompt_token_ids[start : start + n]
                return SequenceChunk(
                    req.request_id,
                    ids,
                    start,
                    buffers.block_table(req.request_id),
                    needs_logits=True,
                    serial=req.serial,
                )

            logits = [
                engine.executor.execute(ModelBatch([chunk(request, 0, 7), chunk(other, 0, 6)])).logits,
                engine.executor.execute(ModelBatch([chunk(request, 7, 6)])).logits,  # "o" skipped
                engine.executor.execute(ModelBatch([chunk(request, 13, 6), chunk(other, 0, 6)])).logits,
            ]
            results.append(logits)
            buffers.free(request)
            buffers.free(other)
        for ours, ref in zip(results[1], results[0], strict=True):
            torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
        rows = [message[1] for message in sent if message[0] == "batch"]
        # (entries the rank has, entries sent) per chunk: "r" (two 16-token pages) is sent whole once, then
        # nothing; "o" is forgotten while skipped and sent whole again.
        assert [[(row[5], len(row[6])) for row in batch] for batch in rows] == [
            [(0, 2), (0, 1)],
            [(2, 0)],
            [(2, 0), (0, 1)],
        ]
    finally:
        llm.engine.shutdown()


def test_a_rank_that_ends_before_joining_the_group_is_reported_at_once(tiny_qwen3):
    """A rank that reached the store but died before its group formed: rank 0 does not wait out the
    group's timeout, and names the rank."""
    from pegainfer.config.compose import build_engine_config, compose
    from pegainfer.executor.step_channel import ShmChannel
    from pegainfer.executor.tp_launch import SpawnedRanks

    config = build_engine_config(
        compose("generate", [f"model.path={tiny_qwen3}", "device=cpu", "tp=2", "parallel.timeout_s=60"])
    )
    channel = ShmChannel(1, 60)
    ranks = SpawnedRanks(config, channel)
    try:
        os.kill(ranks.processes[0].pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(ExecutorError, match="rank 1 failed to start"):
            ranks.join_group(lambda: time.sleep(60))
        assert time.monotonic() - started < 5
    finally:
        ranks.terminate(grace_s=0.0, cut_lifelines=True)
        ranks.release()
        channel.close()


def test_a_refused_call_does_not_fail_the_ranks(tiny_qwen3):
    """Rank 0 refuses what it cannot do before telling the others, so the executor lives on."""
    llm = _tp_llm(tiny_qwen3)
    try:
        with pytest.raises(ExecutorError, match="need a CUDA device"):
            llm.engine.executor.capture_cuda_graphs()  # on the CPU only the eager path exists
        with pytest.raises(ExecutorError, match="does not draft"):
            llm.engine.executor.propose([])
        assert llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=GREEDY, use_tqdm=False)
    finally:
        llm.engine.shutdown()


def test_an_executor_dropped_without_shutdown_ends_its_workers_at_once(tiny_qwen3):
    import gc

    llm = _tp_llm(tiny_qwen3)
    pids = [p.pid for p in _workers(llm)]
    started = time.monotonic()
    del llm
    gc.collect()
    _wait_gone(pids, timeout=5.0)
    assert time.monotonic() - started < 3


def test_engines_in_turn_leave_no_file_descriptor_behind(tiny_qwen3):
    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    _tp_llm(tiny_qwen3).engine.shutdown()  # the first engine opens what stays open (imports, the store)
    before = open_fds()
    for _ in range(2):
        _tp_llm(tiny_qwen3).engine.shutdown()
    assert open_fds() == before
