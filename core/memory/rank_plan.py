"""One rank's memory plan: its budget, every transient of a step on it, and the page count all ranks share.

Each tensor-parallel rank plans from its own shard (its weight bytes, its heads' KV per token, its heads'
recurrent state) and its own device's free memory; the ranks then take the smallest page count any of
them can hold, so a page index means a page on every rank.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from pegainfer.config.schema import EngineConfig
from pegainfer.errors import PluginError
from pegainfer.memory.buffer_specs import BufferSpec, TransientSpec, dtype_size
from pegainfer.memory.decode_buffers import decode_buffers_bytes, graph_buckets
from pegainfer.memory.memory_plan import MemoryPlan, plan_memory
from pegainfer.memory.prefill_graph_inputs import (
    bucket_logit_rows,
    prefill_graph_buckets,
    prefill_graph_inputs_bytes,
    prefill_graph_shape,
)
from pegainfer.model.model_loader import LoadedModel
from pegainfer.parallel.distributed import TensorParallel
from pegainfer.scheduling.scheduler import PROMPT_LOGPROBS_CHUNK

#: What the graphs keep beyond their activations and outputs: the capture stream's cuBLAS workspace (32
#: MiB on Hopper) and the pool's rounding to whole segments.
GRAPH_SLACK = 64 << 20


def memory_budget(loaded: LoadedModel, config: EngineConfig, transient_bytes: int) -> int:
    """Bytes this rank may hold in all: on a GPU a fraction of the device; on the CPU weights +
    transients + the configured KV budget."""
    if loaded.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(loaded.device)
        # Memory our allocator holds (weights, its cache) is ours, not another process's.
        used_by_others = total - free - torch.cuda.memory_reserved(loaded.device)
        return int(total * config.cache.gpu_memory_utilization) - used_by_others
    return loaded.weight_bytes + transient_bytes + config.cache.cpu_kv_cache_bytes


def prefix_caching_enabled(loaded: LoadedModel, config: EngineConfig) -> bool:
    """Whether this model runs with prefix caching: asked for, and not refused by the model."""
    return config.cache.enable_prefix_caching and loaded.model.prefix_caching_refusal is None


def block_size_of(loaded: LoadedModel, config: EngineConfig) -> int:
    """Tokens a KV page holds: ``cache.block_size``, or the model's ``default_block_size``."""
    return config.cache.block_size or loaded.model.default_block_size


def step_transients(loaded: LoadedModel, config: EngineConfig, *, graphs: bool) -> list[TransientSpec]:
    """The model's transients plus what the sampler, the decode buffers and the CUDA graphs take."""
    model, sched = loaded.model, config.scheduler
    vocab = model.vocab_size
    num_spec = config.speculative.num_tokens
    max_blocks = -(-loaded.max_model_len // block_size_of(loaded, config))
    specs = [
        *model.transient_specs(),
        # Logits of the sampled rows (1 + drafts per request) and the sampler's working copies of them.
        TransientSpec("sampler", bytes_per_seq=(4 + num_spec) * vocab * dtype_size(torch.float32)),
        # Prompt logprobs: the logits of one bounded chunk and their log-softmax copy.
        TransientSpec("prompt_logprobs", bytes_fixed=2 * PROMPT_LOGPROBS_CHUNK * vocab * 4),
        # Persistent decode inputs: a block-table row and a few int64s per request.
        TransientSpec("decode_buffers", bytes_fixed=decode_buffers_bytes(sched.max_num_seqs, max_blocks)),
    ]
    if graphs:
        # The graph pool keeps the largest bucket's activations (one token per row, as the model declares
        # them per token) and every bucket's static logits (at max_num_seqs 256 about 8.6 rows a
        # request), beside GRAPH_SLACK.
        per_row = sum(t.bytes_per_token for t in model.transient_specs())
        logits = sum(graph_buckets(sched.max_num_seqs)) * 4 * vocab
        specs.append(TransientSpec("cuda_graphs", bytes_fixed=GRAPH_SLACK + logits, bytes_per_seq=per_row))
        tokens, segments = prefill_graph_shape(
            model.prefill_graph_tokens,
            config.prefill_graph_max_tokens,
            sched.max_num_batched_tokens,
            sched.max_num_seqs,
        )
        if tokens:
            # The same pool: the largest bucket's activations, and what every bucket's graph keeps as its
            # outputs: the logits of 1 + num_spec rows a segment (a verification samples its known token
            # and each draft) and every token's final hidden state.
            if not model.hidden_size:
                raise PluginError(
                    f"{type(model).__name__} runs prefill graphs (prefill_graph_tokens "
                    f"{model.prefill_graph_tokens}) but declares no hidden_size: the memory plan sizes the "
                    "graphs' hidden-state outputs by it"
                )
            buckets = prefill_graph_buckets(tokens)
            hidden = model.hidden_size * dtype_size(loaded.dtype)
            rows = segments * (1 + num_spec)
            outputs = sum(bucket_logit_rows(size, rows) * 4 * vocab + size * hidden for size in buckets)
            inputs = prefill_graph_inputs_bytes(tokens, segments, max_blocks, 1 + num_spec)
            specs.append(TransientSpec("prefill_graphs", bytes_fixed=tokens * per_row + outputs + inputs))
            if config.speculative.mtp_tokens:
                # The drafter's (MTP) graphs of the same buckets (their activations reuse the pool): each keeps
                # a logits row a segment and every token's output hidden state; and their own inputs,
                # hidden states included.
                outputs = sum(
                    bucket_logit_rows(size, segments) * 4 * vocab + size * hidden for size in buckets
                )
                inputs = prefill_graph_inputs_bytes(tokens, segments, max_blocks) + tokens * hidden
                specs.append(TransientSpec("draft_graphs", bytes_fixed=outputs + inputs))
    return specs


def plan_rank_memory(
    loaded: LoadedModel,
    config: EngineConfig,
    specs: list[BufferSpec],
    tp: TensorParallel,
    *,
    graphs: bool,
    budget: int | None = None,
) -> MemoryPlan:
    """This rank's plan, with the page count every rank of ``tp`` can hold (a collective at tp > 1).
    ``budget``: the bytes the rank may hold, given instead of asked of its device (a plan for a GPU this
    process has not got, as ``pegainfer_deepseek.sizing`` makes); None: ``memory_budget``."""
    sched = config.scheduler
    caching = prefix_caching_enabled(loaded, config)
    transients = step_transients(loaded, config, graphs=graphs)
    reserved = sum(t.bytes_for(sched.max_num_batched_tokens, sched.max_num_seqs) for t in transients)
    plan = plan_memory(
        budget=memory_budget(loaded, config, reserved) if budget is None else budget,
        weight_bytes=loaded.weight_bytes,
        specs=specs,
        transients=transients,
        block_size=block_size_of(loaded, config),
        max_num_seqs=sched.max_num_seqs,
        max_num_batched_tokens=sched.max_num_batched_tokens,
        max_model_len=loaded.max_model_len,
        num_blocks_override=config.cache.num_gpu_blocks_override,
        prefix_caching=caching,
        num_state_snapshots=config.cache.num_state_snapshots if caching else None,
        draft_snapshots_per_seq=config.speculative.num_tokens,
        # With prefix caching spare pages keep prefixes cached; on the CPU the budget is explicit and
        # pages beyond what max_num_seqs requests use would only cost allocation time.
        cap_pages=not (caching and loaded.device.type == "cuda"),
    )
    # Page and snapshot indices must mean the same on every rank: each takes the smallest count.
    return replace(
        plan,
        num_blocks=tp.min_int(plan.num_blocks),
        num_snapshot_slots=tp.min_int(plan.num_snapshot_slots),
    )
