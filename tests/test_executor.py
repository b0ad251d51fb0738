"""Executor capabilities: a model that does not embed on the device gets its input embeddings from its
model runner (``batch.hidden_states``), on the plain and the decode-graph path, with the same output as
embedding inside the forward; shutdown releases the runner."""

from __future__ import annotations

import weakref

import pytest

from pegainfer import LLM, SamplingParams
from pegainfer.errors import ExecutorError
from pegainfer_qwen3_14b.model import Qwen3ForCausalLM


class HostEmbeddedQwen3(Qwen3ForCausalLM):
    """Qwen3 fed host-prepared hidden states, the contract DeepSeek's executor uses."""

    embeds_on_device = False

    def forward(self, batch, caches, states):
        assert batch.hidden_states is not None, "the runner must embed for a model that does not"
        return self.run_layers(batch.hidden_states, batch, caches)


@pytest.fixture()
def host_llm(tiny_qwen3, monkeypatch):
    import pegainfer_qwen3_14b.model as module

    monkeypatch.setattr(module, "Qwen3ForCausalLM", HostEmbeddedQwen3)
    return LLM(str(tiny_qwen3), device="cpu", cpu_kv_cache_bytes=4 << 20)


def test_capability_is_declared(host_llm):
    assert host_llm.engine.executor.capabilities.device_embedding is False


PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = [[3, 4, 5, 6], [9], list(range(30, 50))]


@pytest.fixture(scope="module")
def device_embedded_tokens(tiny_qwen3):
    """Module-scoped, so it is built before the function-scoped patch of ``host_llm``."""
    outs = LLM(str(tiny_qwen3), device="cpu", cpu_kv_cache_bytes=4 << 20).generate(
        prompt_token_ids=PROMPTS, sampling_params=PARAMS, use_tqdm=False
    )
    return [o.outputs[0].token_ids for o in outs]


def test_runner_passes_hidden_states_and_output_is_unchanged(device_embedded_tokens, host_llm):
    host = host_llm.generate(prompt_token_ids=PROMPTS, sampling_params=PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in host] == device_embedded_tokens


def test_decode_graph_path_embeds_the_tokens_itself(device_embedded_tokens, host_llm):
    """The decode-graph path (its eager form on the CPU) hands the model embeddings it made from the
    graph's token buffer, so a model that does not embed decodes there too, with the same tokens."""
    host_llm.engine.executor.capture_cuda_graphs(eager=True)
    graphs = host_llm.engine.executor.runner.graphs
    run, sizes = graphs.run, []
    graphs.run = lambda batch: sizes.append(batch) or run(batch)
    host = host_llm.generate(prompt_token_ids=PROMPTS, sampling_params=PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in host] == device_embedded_tokens
    assert len(sizes) > 5, "decode steps did not take the graph path"


def test_shutdown_releases_the_runner_even_when_held_in_a_cycle(tiny_qwen3):
    """A local executor's shutdown drops its runner (weights, caches, graphs), so the next engine in this
    process gets the memory back; a patched method closing over the engine must not keep it alive."""
    llm = LLM(str(tiny_qwen3), device="cpu", cpu_kv_cache_bytes=4 << 20)
    executor = llm.engine.executor
    engine = llm.engine
    executor.propose = lambda inputs: engine.executor.runner.propose(inputs)  # engine -> executor -> engine
    model = weakref.ref(executor.runner.model)
    llm.engine.shutdown()
    assert model() is None
    with pytest.raises(ExecutorError, match="shut down"):
        executor.execute(None)
    llm.engine.shutdown()  # idempotent
