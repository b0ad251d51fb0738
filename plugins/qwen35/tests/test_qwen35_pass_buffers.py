"""The prefill pass-buffer set: what ``transient_specs`` declares is what a forward allocates, every
declared buffer is used, depth does not grow it, and the memory plan reserves it before the pages."""

from __future__ import annotations

import random

import torch

from pegainfer import LLM, SamplingParams
from pegainfer.model.checkpoint import read_hf_config
from pegainfer_qwen35 import pass_buffers
from pegainfer_qwen35.config import Qwen35Config

SCRATCH = pass_buffers.SCRATCH_ROLES


def test_declared_bytes_equal_what_a_chunk_allocates(tiny_qwen35):
    budget, seqs = 96, 4
    llm = LLM(
        str(tiny_qwen35),
        dtype="float32",
        device="cpu",
        max_num_batched_tokens=budget,
        max_num_seqs=seqs,
        cpu_kv_cache_bytes=4 << 20,
        enable_prefix_caching=False,  # one chunk: no cut at the prompt's snapshot boundary
    )
    model = llm.engine.executor.runner.model
    allocated: list[pass_buffers.PassBuffers] = []
    allocate = model.allocate_pass_buffers

    def poisoned(num_tokens: int) -> pass_buffers.PassBuffers:
        bufs = allocate(num_tokens)
        for tensor in bufs.tensors.values():
            tensor.fill_(float("nan"))  # anything a forward leaves unwritten stays NaN
        allocated.append(bufs)
        return bufs

    model.allocate_pass_buffers = poisoned
    prompt = random.Random(0).choices(range(990), k=57)
    llm.generate(
        prompt_token_ids=[prompt],
        sampling_params=SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
        use_tqdm=False,
    )
    assert len(allocated) == 1  # one prefill forward, one pass-buffer set for all its layers
    bufs = allocated[0]
    assert bufs.num_tokens == len(prompt)
    specs = {spec.role: spec for spec in model.transient_specs()}
    declared = sum(spec.bytes_for(len(prompt), 0) for role, spec in specs.items() if role not in SCRATCH)
    assert bufs.nbytes == declared
    assert {pass_buffers.ROLE_PREFIX + name for name in bufs.tensors} == set(specs) - SCRATCH
    unwritten = [name for name, tensor in bufs.tensors.items() if tensor.isnan().any()]
    assert unwritten == []
    # The memory plan reserved every role at the step's token budget, before sizing the page pool.
    plan = llm.engine.executor.plan
    for role, spec in specs.items():
        assert plan.transients[role] == spec.bytes_for(budget, seqs) > 0
    assert plan.budget - plan.weight_bytes - plan.transient_bytes - plan.state_bytes >= plan.kv_bytes


def test_pass_buffers_do_not_grow_with_depth(tiny_qwen35):
    hf_config = read_hf_config(tiny_qwen35)
    text = hf_config["text_config"]
    deeper = {
        **hf_config,
        "text_config": {**text, "num_hidden_layers": 8, "layer_types": text["layer_types"] * 2},
    }
    shallow, deep = (Qwen35Config.from_hf_config(c) for c in (hf_config, deeper))
    assert deep.num_layers == 2 * shallow.num_layers
    assert pass_buffers.transient_specs(deep, torch.float32) == pass_buffers.transient_specs(
        shallow, torch.float32
    )
