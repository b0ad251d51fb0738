"""Qwen3.5's multi-token-prediction (MTP) draft module, as the published checkpoints ship it (``mtp.*``).

For a position p it combines the main model's final hidden state there with the embedding of the token at
p + 1 and predicts the token at p + 2: ``x = fc([norm_e(embed(t_{p+1})) ; norm_h(h_p)])``, one full
(gated) attention decoder layer over its own paged KV cache (layer index ``num_hidden_layers``, the main
layers' block table), the final ``mtp.norm``, then the main model's lm_head. All three norms are
zero-centred ``(1 + w)``. Its output hidden state feeds a further chained draft. The module keeps no
recurrent state: rolling a rejected draft back out of the main model's GDN state is the engine's job
(``docs/speculative.md``).

Tensor parallelism: ``fc`` is replicated (it is one ``[H, 2H]`` matrix), the decoder layer shards as the
main layers do.
"""

from __future__ import annotations

import torch
from torch import nn

from pegainfer import ops
from pegainfer.model.checkpoint import CheckpointReader
from pegainfer.parallel.distributed import TensorParallel
from pegainfer_qwen35.config import Qwen35Config
from pegainfer_qwen35.norms import rms_norm_zero_centred

#: The checkpoint's prefix of the module.
PREFIX = "mtp."


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class MultiTokenPredictor(nn.Module):
    def __init__(
        self,
        config: Qwen35Config,
        layer: nn.Module,
        dtype: torch.dtype,
        tp: TensorParallel | None = None,
    ) -> None:
        """``layer``: the module's decoder layer (a ``Qwen35DecoderLayer`` built with ``draft=True``)."""
        super().__init__()
        h = config.hidden_size
        self.config = config
        self.tp = tp or TensorParallel()
        self.pre_fc_norm_embedding = _param(h, dtype=dtype)
        self.pre_fc_norm_hidden = _param(h, dtype=dtype)
        self.fc = _param(h, 2 * h, dtype=dtype)
        self.layer = layer
        self.norm = _param(h, dtype=dtype)

    @property
    def layer_index(self) -> int:
        return self.layer.layer_index

    @staticmethod
    def present_in(reader: CheckpointReader) -> bool:
        """Whether the checkpoint holds the module whole (some re-published files keep only its head)."""
        return f"{PREFIX}fc.weight" in reader and f"{PREFIX}layers.0.input_layernorm.weight" in reader

    def load(self, reader: CheckpointReader) -> None:
        h = self.config.hidden_size
        dtype = self.fc.dtype
        with torch.no_grad():
            self.fc.copy_(reader.get(f"{PREFIX}fc.weight", (h, 2 * h), dtype))
            for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
                getattr(self, name).copy_(reader.get(f"{PREFIX}{name}.weight", (h,), dtype))
        self.layer.load(reader, f"{PREFIX}layers.0.")

    def combine(self, embedded: torch.Tensor, hidden: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The decoder layer's input ``fc([norm_e(embedded) ; norm_h(hidden)])``, into ``out``."""
        eps = self.config.rms_norm_eps
        both = torch.cat(
            [
                rms_norm_zero_centred(embedded, self.pre_fc_norm_embedding, eps),
                rms_norm_zero_centred(hidden.to(embedded.dtype), self.pre_fc_norm_hidden, eps),
            ],
            dim=-1,
        )
        return out.copy_(ops.linear(both, self.fc))
