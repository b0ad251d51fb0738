"""What one tensor-parallel rank of the DeepSeek plugin holds, checked without starting any rank: a model
built for rank r of 2 (no collective is called while building or loading) holds exactly rank r's slices
of the one-rank model's weights, FP8 checkpoints included (shard boundaries inside scale blocks), reads
every tensor, and never a whole scale tensor for a sharded weight. Counts tp does not divide, and
DeepSeek-V4 at tp > 1, fail with a ConfigError saying why before any weight is read.

The engines of two ranks are in ``test_deepseek_tensor_parallel.py`` (slow).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pegainfer.config.schema import ModelConfig
from pegainfer.errors import ConfigError
from pegainfer.model.checkpoint import CheckpointReader
from pegainfer.parallel.distributed import TensorParallel
from pegainfer_deepseek.config import DeepseekV3Dims
from pegainfer_deepseek.model import DeepseekV3ForCausalLM
from pegainfer_deepseek.tiny import UNALIGNED_SHAPE, deepseek_v3_config, write_fp8_copy
from pegainfer_deepseek.v4_model import DeepseekV4ForCausalLM


def _tp(rank: int, size: int = 2) -> TensorParallel:
    return TensorParallel(rank=rank, size=size, group=object()) if size > 1 else TensorParallel()


def _load(folder: Path, rank: int, size: int) -> tuple[DeepseekV3ForCausalLM, CheckpointReader]:
    dims = DeepseekV3Dims.from_hf_config(json.loads((folder / "config.json").read_text()))
    model = DeepseekV3ForCausalLM(dims, dtype=torch.float32, max_model_len=64, tp=_tp(rank, size))
    reader = CheckpointReader(folder, rank=rank, world_size=size)
    model.load_weights(reader)
    return model, reader


def _chunk(t: torch.Tensor, dim: int, rank: int, size: int = 2) -> torch.Tensor:
    return t.chunk(size, dim=dim)[rank]


def _vocab_rows(t: torch.Tensor, rank: int, size: int = 2) -> torch.Tensor:
    rows = -(-t.shape[0] // size)
    part = t[rank * rows : (rank + 1) * rows]
    return torch.cat([part, part.new_zeros(rows - part.shape[0], *part.shape[1:])])


def _gate_up(t: torch.Tensor, dim: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s part of a packed [gate | up] along ``dim``: its gate rows, then its up rows."""
    gate, up = t.chunk(2, dim=dim)
    return torch.cat([_chunk(gate, dim, rank), _chunk(up, dim, rank)], dim=dim)


def expected_shard(
    name: str, full: torch.Tensor, rank: int, q_proj_rows: int = 0, columns: tuple[int, int] | None = None
) -> torch.Tensor:
    """The slice of the one-rank model's parameter ``name`` that rank ``rank`` of 2 must hold;
    ``q_proj_rows``: the rows of a head-split ``q_proj`` atop the replicated latent in ``in_proj``. A
    block-FP8 projection (``X.weight``, float8, and ``X.scale``, per-row tile scales) is split as the plain
    ``X``, except the scales of a column-split one: the tiles (``columns``: the weight's column count and
    tile width) that cover the rank's columns."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf in ("weight", "scale") and "." in name:
        leaf, part = name.rsplit(".", 2)[-2], leaf
        if part == "scale" and leaf in ("o_proj", "down_proj"):
            assert columns is not None
            k, block = columns
            start, stop = rank * k // 2, (rank + 1) * k // 2
            return full[:, start // block : -(-stop // block)]
    if leaf in ("in_proj", "in_bias") and q_proj_rows:
        return torch.cat([_chunk(full[:q_proj_rows], 0, rank), full[q_proj_rows:]])
    if leaf in ("embed_tokens", "lm_head", "head"):
        return _vocab_rows(full, rank)
    if leaf in ("q_b_proj", "kv_b_proj"):
        return _chunk(full, 0, rank)  # by heads
    if leaf in ("o_proj", "down_proj"):
        return _chunk(full, 1, rank)
    if leaf == "gate_up_proj":  # gate, up rows interleaved: a rank's features are contiguous pairs
        return _chunk(full, 0, rank)
    if leaf == "experts_gate_up":
        return _gate_up(full, 1, rank)
    if leaf == "experts_down":
        return _chunk(full, 2, rank)
    if leaf in ("experts_gate_up_scale", "experts_down_scale"):
        return full  # the float8 experts' tiles (fp8-128): both ranks' 24 features lie in tile 0 of 128
    return full  # replicated: norms, biases, router, latent projections, indexer, eh_proj


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint_factory, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp-shards")
    # Per rank 2 heads (q_b 64 rows, kv_b 80 rows, o_proj 48 columns), 144 dense and 24 expert features:
    # no shard lines up with the 128x128 (or 48x40) blocks.
    wide = tiny_checkpoint_factory("deepseek_v3", seed=5, **UNALIGNED_SHAPE)
    return {
        # A vocabulary two ranks do not divide (the last rank's rows are zero padding), attention biases.
        "v3": tiny_checkpoint_factory("deepseek_v3", vocab_size=1001, attention_bias=True),
        "v3-no-q-lora": tiny_checkpoint_factory("deepseek_v3", q_lora_rank=None, first_k_dense_replace=2),
        "v32": tiny_checkpoint_factory("deepseek_v32"),
        "fp8-128": write_fp8_copy(wide, root / "fp8-128"),
        "fp8-48x40": write_fp8_copy(wide, root / "fp8-48x40", block_size=(48, 40)),
    }


@pytest.mark.parametrize("name", ["v3", "v3-no-q-lora", "v32", "fp8-128", "fp8-48x40"])
@pytest.mark.parametrize("rank", [0, 1])
def test_rank_holds_its_slices_of_the_full_model(checkpoints, name: str, rank: int) -> None:
    folder = checkpoints[name]
    one_rank = _load(folder, 0, 1)[0]
    full = dict(one_rank.named_parameters())
    q_proj_rows = one_rank.layers[0].self_attn.q_rows if one_rank.dims.q_lora_rank is None else 0
    model, reader = _load(folder, rank, 2)
    sharded = dict(model.named_parameters())
    assert sharded.keys() == full.keys()
    for key, param in sharded.items():
        projection = one_rank.get_submodule(key.rsplit(".", 1)[0]) if key.endswith(".scale") else None
        columns = (projection.shape[1], projection.block) if projection is not None else None
        expected = expected_shard(key, full[key], rank, q_proj_rows, columns)
        assert param.shape == expected.shape, key
        assert torch.equal(param, expected), key  # FP8: the same products, element by element
    if name != "v32":  # V3.2's MTP layer is not served
        assert reader.unused() == []
    # Rank-local shapes where it matters: two of four heads, half the features.
    attn = model.layers[-1].self_attn
    assert attn.num_heads == 2 and attn.kv_b_proj.shape[0] == 2 * (16 + 24)
    assert model.layers[-1].mlp.experts_down.shape[-1] == model.dims.moe_intermediate_size // 2
    if name == "fp8-128":  # float8 experts: rank 1's features start 24 into their tile
        assert model.layers[-1].mlp.experts_down.dtype == torch.float8_e4m3fn
        assert model.layers[-1].mlp.scale_offset == 24 * rank


def test_a_sharded_fp8_weight_reads_only_its_scale_tiles(checkpoints, monkeypatch) -> None:
    reads: list[tuple[str, object]] = []
    real = CheckpointReader.get

    def get(self, name, shape=None, dtype=None, shard=None):
        tensor = real(self, name, shape, dtype, shard)
        reads.append((name, shard, tuple(tensor.shape)))
        return tensor

    monkeypatch.setattr(CheckpointReader, "get", get)
    _load(checkpoints["fp8-48x40"], 1, 2)
    scales = {name: (shard, shape) for name, shard, shape in reads if name.endswith("_scale_inv")}
    sharded = {name + "_scale_inv" for name, shard, _ in reads if shard is not None}
    assert sharded & scales.keys()
    for name in sharded & scales.keys():
        assert scales[name][0] is not None, f"{name} was read whole"
    # Rank 1's dense features [144, 288) (columns of down_proj, 40 wide tiles): tiles 3 to 7 of 8.
    assert scales["model.layers.0.mlp.down_proj.weight_scale_inv"][1] == (4, 5)
    # Its 64 of 128 q_b_proj rows, [64, 128) in 48-row tiles: tiles 1 and 2 of 3.
    assert scales["model.layers.1.self_attn.q_b_proj.weight_scale_inv"][1] == (2, 4)


def test_transient_specs_count_the_rank_local_geometry(checkpoints) -> None:
    folder = checkpoints["v3"]
    one, two = _load(folder, 0, 1)[0], _load(folder, 1, 2)[0]
    assert two.transient_specs()[0].bytes_per_token < one.transient_specs()[0].bytes_per_token
    assert two.buffer_specs() == one.buffer_specs()  # the latent cache holds the whole latent


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"num_attention_heads": 3},
            "num_attention_heads: 3 cannot be split evenly over tensor-parallel size 2",
        ),
        ({"moe_intermediate_size": 33}, "moe_intermediate_size: 33 cannot be split evenly"),
        ({"intermediate_size": 129}, "intermediate_size: 129 cannot be split evenly"),
    ],
)
def test_counts_tp_does_not_divide_are_named(overrides: dict, message: str) -> None:
    dims = DeepseekV3Dims.from_hf_config(deepseek_v3_config(1024, **overrides))
    with pytest.raises(ConfigError, match=message):
        DeepseekV3ForCausalLM(dims, dtype=torch.float32, max_model_len=64, tp=_tp(0))
    with pytest.raises(ConfigError, match=message):
        DeepseekV3ForCausalLM.from_hf_config(
            deepseek_v3_config(1024, **overrides),
            ModelConfig(),
            dtype=torch.float32,
            max_model_len=64,
            tp=_tp(1),
        )


def test_v4_refuses_tensor_parallelism(tiny_checkpoint_factory) -> None:
    folder = tiny_checkpoint_factory("deepseek_v4")
    cfg = json.loads((folder / "config.json").read_text())
    with pytest.raises(
        ConfigError, match=r"DeepSeek-V4 does not support tensor parallelism yet .*hyper-connection"
    ):
        DeepseekV4ForCausalLM.from_hf_config(
            cfg, ModelConfig(), dtype=torch.float32, max_model_len=64, tp=_tp(0)
        )
    # One rank is fine, with or without the keyword.
    DeepseekV4ForCausalLM.from_hf_config(
        cfg, ModelConfig(), dtype=torch.float32, max_model_len=64, tp=TensorParallel()
    )
