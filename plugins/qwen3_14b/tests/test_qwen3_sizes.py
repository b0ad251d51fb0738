"""Every published Qwen3 dense size builds with the same parameter shapes as transformers' model."""

from __future__ import annotations

import pytest
import torch

from pegainfer.config.schema import ModelConfig
from pegainfer_qwen3_14b.model import Qwen3ForCausalLM

# (hidden, intermediate, layers, q heads, tied) of Qwen3-0.6B ... 32B; all have 8 KV heads, head_dim 128.
SIZES = {
    "0.6B": (1024, 3072, 28, 16, True),
    "1.7B": (2048, 6144, 28, 16, True),
    "4B": (2560, 9728, 36, 32, True),
    "8B": (4096, 12288, 36, 32, False),
    "14B": (5120, 17408, 40, 40, False),
    "32B": (5120, 25600, 64, 64, False),
}


def _config(hidden: int, inter: int, layers: int, heads: int, tied: bool) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000,
        "tie_word_embeddings": tied,
        "attention_bias": False,
    }


@pytest.mark.parametrize("size", list(SIZES))
def test_parameter_count_equals_transformers(size: str) -> None:
    from transformers import Qwen3Config
    from transformers import Qwen3ForCausalLM as HFQwen3

    cfg = _config(*SIZES[size])
    with torch.device("meta"):
        ours = Qwen3ForCausalLM.from_hf_config(cfg, ModelConfig(), dtype=torch.bfloat16, max_model_len=128)
        theirs = HFQwen3(Qwen3Config(**cfg))
    count = sum(p.numel() for p in ours.parameters())
    # parameters() counts a tied embedding once, as ours (which has no separate lm_head then) does. Ours
    # holds no weight for the norms folded into projections: two a layer, and the final one when untied.
    folded_norms = (2 * cfg["num_hidden_layers"] + (not cfg["tie_word_embeddings"])) * cfg["hidden_size"]
    assert count + folded_norms == sum(p.numel() for p in theirs.parameters())
    if size == "14B":
        assert round(count / 1e9, 1) == 14.8
