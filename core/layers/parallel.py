"""Tensor-parallel pieces model files share: the vocab-parallel embedding and logits.

A vocab-parallel table holds rows ``[rank * rows, (rank + 1) * rows)`` of the vocabulary
(``sharding.vocab_shard``; the last rank's tail is zero padding). The embedding looks up the ids in
the rank's range, zeroes the rest and sums over the ranks; the logits of each rank's rows are gathered
in rank order and the padding cut off. At tp = 1 both are the plain operations.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pegainfer.parallel.distributed import TensorParallel


def vocab_parallel_embed(token_ids: torch.Tensor, weight: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Rows of the full embedding table for ``token_ids``, from this rank's shard ``weight``."""
    if tp.group is None:
        return F.embedding(token_ids, weight)
    rows = weight.shape[0]
    local = token_ids - tp.rank * rows
    outside = (local < 0) | (local >= rows)
    out = F.embedding(local.clamp(0, rows - 1), weight).masked_fill_(outside.unsqueeze(-1), 0)
    return tp.all_reduce(out)


def gather_logits(local: torch.Tensor, tp: TensorParallel, vocab_size: int) -> torch.Tensor:
    """The full ``[N, vocab_size]`` logits from each rank's ``[N, rows]`` (float32, as the sampler takes)."""
    if tp.group is None:
        return local.float()
    full = tp.all_gather(local, dim=-1)
    return (full if full.shape[-1] == vocab_size else full[..., :vocab_size]).float()
