"""DeepSeek-V4 tensor names: the model asks in DeepSeek's release spelling, three spellings are accepted.

* DeepSeek's release files: ``embed.weight``, ``layers.3.attn.wq_a.weight``, ``layers.3.ffn.experts.0.w1.weight``,
  ``hc_head_fn``, ...
* What transformers' ``save_pretrained`` writes (its conversion table reversed, partly): the release
  names of the layers under ``model.``, plus ``model.embed_tokens.weight``, ``model.norm.weight``,
  ``model.hc_head.hc_fn`` and ``head.weight``.
* transformers' module names (``model.layers.3.self_attn.q_a_proj.weight``, fused
  ``mlp.experts.gate_up_proj``), as a converted folder may hold them.

A tensor found under none of them raises the reader's CheckpointError for the release name, which also
lists the other spellings tried.
"""

from __future__ import annotations

import re

import torch

from pegainfer.errors import CheckpointError
from pegainfer_deepseek.fp8 import WeightReader

# Release spelling -> transformers' module spelling, applied in order (the specific indexer paths first).
_TO_MODULE_NAMES: tuple[tuple[str, str], ...] = (
    (r"^embed\.weight$", "embed_tokens.weight"),
    (r"^head\.weight$", "lm_head.weight"),
    (r"^hc_head_(fn|base|scale)$", r"hc_head.hc_\1"),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_(fn|base|scale)$", r".attn_hc.\1"),
    (r"\.hc_ffn_(fn|base|scale)$", r".ffn_hc.\1"),
    (r"\.attn\.indexer\.compressor\.", ".attn.compressor.indexer."),
    (r"\.attn\.indexer\.wq_b\.", ".attn.compressor.indexer.q_b_proj."),
    (r"\.attn\.indexer\.weights_proj\.", ".attn.compressor.indexer.scorer.weights_proj."),
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.ape$", ".position_bias"),
    (r"\.norm\.weight$", ".kv_norm.weight"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.wq_b\.", ".q_b_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.attn_sink$", ".sinks"),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
)


def module_name(release_name: str) -> str:
    """transformers' module spelling of a release tensor name (``model.`` prefixed but for the head)."""
    name = release_name
    for pattern, replacement in _TO_MODULE_NAMES:
        name = re.sub(pattern, replacement, name)
    return name if name == "lm_head.weight" else "model." + name


class V4Weights:
    """``get`` by release name, in any of the accepted spellings (FP8 blocks dequantized on the way)."""

    def __init__(self, reader: WeightReader) -> None:
        self.reader = reader

    def spellings(self, release_name: str) -> tuple[str, ...]:
        return (release_name, "model." + release_name, module_name(release_name))

    def find(self, release_name: str) -> str | None:
        """The spelling the checkpoint uses, or None."""
        return next((n for n in self.spellings(release_name) if n in self.reader), None)

    def get(self, release_name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        found = self.find(release_name)
        if found is None:
            others = ", ".join(f"'{n}'" for n in self.spellings(release_name)[1:])
            raise CheckpointError(
                f"tensor '{release_name}' is missing from the checkpoint in {self.reader.reader.folder} "
                f"(also looked for {others})"
            )
        return self.reader.get(found, shape, dtype)

    def get_fused_experts(
        self, prefix: str, experts: int, hidden: int, intermediate: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Routed experts as ``(gate|up [E, 2I, H], down [E, H, I])`` from per-expert ``w1``/``w3``/``w2``
        (``prefix`` is e.g. ``layers.3.ffn.``) or from transformers' fused tensors."""
        fused = module_name(prefix + "experts.gate_up_proj")
        if fused in self.reader:
            gate_up = self.reader.get(fused, (experts, 2 * intermediate, hidden), dtype)
            down = self.reader.get(
                module_name(prefix + "experts.down_proj"), (experts, hidden, intermediate), dtype
            )
            return gate_up, down
        gate_up = torch.empty(experts, 2 * intermediate, hidden, dtype=dtype)
        down = torch.empty(experts, hidden, intermediate, dtype=dtype)
        for e in range(experts):
            p = f"{prefix}experts.{e}."
            gate_up[e, :intermediate] = self.get(p + "w1.weight", (intermediate, hidden), dtype)
            gate_up[e, intermediate:] = self.get(p + "w3.weight", (intermediate, hidden), dtype)
            down[e] = self.get(p + "w2.weight", (hidden, intermediate), dtype)
        return gate_up, down
