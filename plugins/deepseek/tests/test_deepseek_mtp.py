"""The MTP module against a direct reference of DeepSeek's published definition.

transformers' generation only finds an MTP layer stored as ``layers.61``, so the reference is assembled
here from the definition: for position i, ``x = eh_proj([enorm(E t_{i+1}) | hnorm(h_i)])``, one full decoder
layer (transformers' ``DeepseekV3DecoderLayer``, MoE, causal over the module's own sequence), then
``shared_head.head(shared_head.norm(x))``, where ``h_i`` is the main model's final normed hidden state.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pegainfer.layers.attention import AttentionMetadata, PrefillSegment
from pegainfer.model.model_api import ForwardBatch
from pegainfer.testing.conformance import hf_model


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _reference_mtp(folder, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(main model hidden states h_0..h_{n-1}, reference MTP logits for rows 0..n-2)."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    main = hf_model(str(folder))
    config = main.config
    layer_index = config.num_hidden_layers
    ids = torch.tensor([tokens])
    with torch.no_grad():
        hidden = main(ids, output_hidden_states=True).hidden_states[-1][0]  # after the final norm
    weights = load_file(str(folder / "model.safetensors"))
    prefix = f"model.layers.{layer_index}."
    mtp = {k.removeprefix(prefix): v for k, v in weights.items() if k.startswith(prefix)}

    block_config = type(config).from_dict(config.to_dict())
    block_config.first_k_dense_replace = 0  # the MTP layer is an MoE layer
    block_config._attn_implementation = "eager"
    block_config._experts_implementation = "eager"
    block = hf.DeepseekV3DecoderLayer(block_config, layer_idx=0).eval()
    state = {k: v for k, v in mtp.items() if ".experts." not in k and k.split(".")[0] in ("self_attn", "mlp")}
    state.update({k: mtp[k] for k in ("input_layernorm.weight", "post_attention_layernorm.weight")})
    experts = config.n_routed_experts
    state["mlp.experts.gate_up_proj"] = torch.stack(
        [
            torch.cat([mtp[f"mlp.experts.{e}.gate_proj.weight"], mtp[f"mlp.experts.{e}.up_proj.weight"]])
            for e in range(experts)
        ]
    )
    state["mlp.experts.down_proj"] = torch.stack(
        [mtp[f"mlp.experts.{e}.down_proj.weight"] for e in range(experts)]
    )
    block.load_state_dict(state, strict=True)

    n, eps = len(tokens) - 1, config.rms_norm_eps
    x = (
        torch.cat(
            [
                _rms(mtp["embed_tokens.weight"][torch.tensor(tokens[1:])], mtp["enorm.weight"], eps),
                _rms(hidden[:n], mtp["hnorm.weight"], eps),
            ],
            dim=-1,
        )
        @ mtp["eh_proj.weight"].T
    )
    positions = torch.arange(n)[None]
    rotary = hf.DeepseekV3RotaryEmbedding(block_config)
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        x = block(
            x[None], attention_mask=mask, position_ids=positions, position_embeddings=rotary(x, positions)
        )[0]
    logits = _rms(x, mtp["shared_head.norm.weight"], eps) @ mtp["shared_head.head.weight"].T
    return hidden, logits


def _table_batch(
    positions: list[int], table: torch.Tensor, block_size: int, decode_rows: int = 0
) -> ForwardBatch:
    """A batch of one prefill segment (all but the last ``decode_rows`` positions) and decode rows that
    continue it, over the single block table ``table``."""
    pos = torch.tensor(positions)
    slots = table[pos // block_size] * block_size + pos % block_size
    n_prefill = len(positions) - decode_rows
    prefills = []
    if n_prefill:
        prefills.append(PrefillSegment(0, n_prefill, positions[n_prefill - 1] + 1, table))
    meta = AttentionMetadata(block_size, slots, prefills, n_prefill)
    if decode_rows:
        meta.num_decodes = decode_rows
        meta.decode_block_tables = table[None].expand(decode_rows, -1)
        meta.decode_seq_lens = pos[n_prefill:] + 1
        meta.max_decode_seq_len = positions[-1] + 1
    return ForwardBatch(torch.zeros(len(positions), dtype=torch.int64), pos, meta)


@pytest.fixture(scope="module")
def draft_llm(tiny_deepseek):
    """The tiny model with drafting on: its MTP module is built only then."""
    from pegainfer import LLM

    return LLM(
        str(tiny_deepseek),
        dtype="float32",
        device="cpu",
        cpu_kv_cache_bytes=8 << 20,
        speculative_num_tokens=1,
    )


@pytest.fixture(scope="module")
def mtp_case(draft_llm, tiny_deepseek):
    rng = random.Random(11)
    tokens = [rng.randrange(990) for _ in range(23)]
    hidden, ref = _reference_mtp(tiny_deepseek, tokens)
    return draft_llm.engine.executor.runner.model, tokens, hidden, ref


def _mtp_cache(model, blocks: int = 8, block_size: int = 4) -> dict[int, torch.Tensor]:
    (spec,) = model.mtp_buffer_specs()
    return {spec.layer_index: torch.zeros(spec.page_shape(blocks, block_size))}


def test_mtp_layer_has_its_own_latent_cache(draft_llm):
    model = draft_llm.engine.executor.runner.model
    (spec,) = model.mtp_buffer_specs()
    assert spec.layer_index == model.dims.num_layers
    assert spec.latent_dim + spec.rope_dim == model.dims.kv_lora_rank + model.dims.qk_rope_head_dim
    assert spec.layer_index not in {s.layer_index for s in model.buffer_specs()}


def test_mtp_prefill_matches_reference(mtp_case):
    model, tokens, hidden, ref = mtp_case
    n = len(tokens) - 1
    table = torch.tensor([5, 2, 7, 0, 3, 1])  # pages out of order
    caches = _mtp_cache(model)
    batch = _table_batch(list(range(n)), table, 4)
    with torch.no_grad():
        logits = model.mtp_forward(hidden[:n], torch.tensor(tokens[1:]), batch, caches)
    err = torch.linalg.vector_norm(logits - ref) / torch.linalg.vector_norm(ref)
    print(f"MTP prefill logits rel err: {err:.2e}")
    assert err < 1e-4
    assert torch.equal(logits.argmax(-1), ref.argmax(-1))


def test_mtp_incremental_drafting_matches_reference(mtp_case):
    """A chunk, then one row at a time through the module's cache (the absorbed decode path)."""
    model, tokens, hidden, ref = mtp_case
    n, first = len(tokens) - 1, 15
    table = torch.tensor([6, 1, 4, 2, 0, 7])
    caches = _mtp_cache(model)
    next_ids = torch.tensor(tokens[1:])
    rows = []
    with torch.no_grad():
        batch = _table_batch(list(range(first)), table, 4)
        rows.append(model.mtp_forward(hidden[:first], next_ids[:first], batch, caches))
        for pos in range(first, n):
            batch = _table_batch([pos], table, 4, decode_rows=1)
            logits, out_hidden = model.mtp_forward(
                hidden[pos : pos + 1], next_ids[pos : pos + 1], batch, caches, return_hidden=True
            )
            assert out_hidden.shape == (1, model.dims.hidden_size)
            rows.append(logits)
    logits = torch.cat(rows)
    err = torch.linalg.vector_norm(logits - ref) / torch.linalg.vector_norm(ref)
    print(f"MTP incremental logits rel err: {err:.2e}")
    assert err < 1e-4


def test_mtp_depth_out_of_range_is_an_error(mtp_case):
    model, *_ = mtp_case
    with pytest.raises(ValueError, match="MTP module"):
        model.mtp_forward(
            torch.zeros(1, model.dims.hidden_size), torch.zeros(1, dtype=torch.int64), None, {}, depth=1
        )


def test_checkpoint_without_mtp_layer_serves_without_drafting(tiny_checkpoint_factory, tmp_path):
    from safetensors.torch import save_file

    from pegainfer import LLM, SamplingParams
    from pegainfer.testing.conformance import unused_checkpoint_tensors

    source = tiny_checkpoint_factory("deepseek_v3")
    folder = Path(shutil.copytree(source, tmp_path / "no-mtp"))
    tensors = load_file(str(folder / "model.safetensors"))
    save_file(
        {k: v for k, v in tensors.items() if not k.startswith("model.layers.3.")},
        str(folder / "model.safetensors"),
    )
    assert unused_checkpoint_tensors(folder) == []
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    stripped = LLM(str(folder), dtype="float32", device="cpu", cpu_kv_cache_bytes=4 << 20)
    full = LLM(str(source), dtype="float32", device="cpu", cpu_kv_cache_bytes=4 << 20)
    assert (
        len(stripped.engine.executor.runner.model.mtp) == 0
        and stripped.engine.executor.runner.model.mtp_buffer_specs() == []
    )
    prompt = [[5, 6, 7, 8, 9]]
    outs = [
        llm.generate(prompt_token_ids=prompt, sampling_params=params, use_tqdm=False)
        for llm in (stripped, full)
    ]
    assert outs[0][0].outputs[0].token_ids == outs[1][0].outputs[0].token_ids


def test_config_without_mtp_builds_no_module(tiny_checkpoint_factory):
    from pegainfer import LLM
    from pegainfer.testing.conformance import unused_checkpoint_tensors

    folder = tiny_checkpoint_factory("deepseek_v3", num_nextn_predict_layers=0)
    assert unused_checkpoint_tensors(folder) == []
    model = LLM(
        str(folder), dtype="float32", device="cpu", cpu_kv_cache_bytes=4 << 20
    ).engine.executor.runner.model
    assert len(model.mtp) == 0


def test_no_draft_module_without_drafting(tiny_deepseek):
    """A run that does not draft builds no MTP module (no memory for it), and its checkpoint tensors are
    skipped on purpose, not reported unused."""
    from pegainfer.config.schema import EngineConfig, ModelConfig
    from pegainfer.model.checkpoint import CheckpointReader
    from pegainfer.model.model_loader import load_model

    model = load_model(EngineConfig(model=ModelConfig(path=str(tiny_deepseek)), device="cpu")).model
    assert len(model.mtp) == 0 and model.mtp_buffer_specs() == []
    reader = CheckpointReader(tiny_deepseek)
    model.load_weights(reader)
    assert any(n.startswith(f"model.layers.{model.dims.num_layers}.") for n in reader.names())
    assert reader.unused() == []


def test_mtp_takes_the_main_tables_where_the_checkpoint_repeats_them(tiny_deepseek, tmp_path):
    """DeepSeek-V3's MTP module shares the embedding and head; its checkpoint stores copies (the tiny one
    too). Where the copies equal the main model's, the module holds the main tensors and the loaded
    weights shrink by both tables; where one differs, the module keeps its own copy of that one. Outputs
    of the sharing model are covered by the speculative tests, which load these checkpoints."""
    from safetensors.torch import save_file

    from pegainfer.config.schema import EngineConfig, ModelConfig, SpeculativeConfig
    from pegainfer.model.model_loader import load_model

    def loaded(folder):
        config = EngineConfig(
            model=ModelConfig(path=str(folder)), speculative=SpeculativeConfig(num_tokens=1), device="cpu"
        )
        return load_model(config)

    shared = loaded(tiny_deepseek)
    model = shared.model
    assert model.mtp[0].embed_tokens is model.embed_tokens and model.mtp[0].head is model.lm_head
    apart = Path(shutil.copytree(tiny_deepseek, tmp_path / "apart"))
    tensors = load_file(str(apart / "model.safetensors"))
    head = f"model.layers.{model.dims.num_layers}.shared_head.head.weight"
    tensors[head] = tensors[head] * 1.5
    save_file(tensors, str(apart / "model.safetensors"))
    own = loaded(apart)
    assert own.model.mtp[0].embed_tokens is own.model.embed_tokens
    assert own.model.mtp[0].head is not own.model.lm_head
    table = model.lm_head.numel() * model.lm_head.element_size()
    assert own.weight_bytes - shared.weight_bytes == table
