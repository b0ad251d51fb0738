"""DeepSeek-V4's KV compressor: every ``ratio`` tokens become one entry of the layer's compressed cache.

Per token it projects a value ``kv`` and a gate. A window of ``ratio`` tokens closes into entry
``w = first_token // ratio``: ``norm(Σ softmax(gate + position_bias) ⊙ kv)`` (softmax over the window
positions, per channel), roped at position ``w·ratio``. Heavily compressed layers (HCA) use one series;
compressed sparse layers (CSA, and their indexer) project two, Ca and Cb, and entry w pools window w-1's
Ca with window w's Cb (2·ratio slots, overlapping windows; the first entry has no Ca half).

Decode and chunked prefill need the projections of tokens whose window has not closed yet, and for CSA
those of the previous window too: the request's state slot keeps the raw projections of the last
``coff·ratio`` tokens (``coff`` 2 for CSA, 1 for HCA) in a ring indexed by ``position mod (coff·ratio)``.
Entries are written to the paged cache as their windows close, so any split of a prompt into chunks,
or a recompute after preemption, pools exactly the same tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pegainfer_deepseek.params import param
from pegainfer_deepseek.v4_primitives import TrailingRope, scaled_rms_norm
from pegainfer_deepseek.v4_sequences import SequenceRows, entry_slots
from pegainfer_deepseek.v4_weights import V4Weights


class Compressor(nn.Module):
    def __init__(
        self, hidden: int, entry_dim: int, ratio: int, *, overlapping: bool, eps: float, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.entry_dim, self.ratio, self.eps = entry_dim, ratio, eps
        self.coff = 2 if overlapping else 1
        width = self.coff * entry_dim
        self.kv_proj = param(width, hidden, dtype=dtype)
        self.gate_proj = param(width, hidden, dtype=dtype)
        self.position_bias = param(ratio, width, dtype=torch.float32)
        self.kv_norm = param(entry_dim, dtype=torch.float32)

    @property
    def ring_shape(self) -> tuple[int, int]:
        """Per-request carry-over: raw ``[kv | gate]`` projections of the last ``coff·ratio`` tokens."""
        return (self.coff * self.ratio, 2 * self.coff * self.entry_dim)

    def forward(
        self,
        x: torch.Tensor,
        seqs: list[SequenceRows],
        ring: torch.Tensor,
        cache: torch.Tensor,
        block_size: int,
        rope: TrailingRope,
    ) -> None:
        """Close every window that ends in this batch into ``cache`` and update the rings.

        ``x`` is the layer's normed input ``[T, H]``, ``ring`` the state pool ``[slots, *ring_shape]``,
        ``cache`` the ``PagedCompressedSpec`` pages ``[blocks, rows, entry_dim]``."""
        projected = torch.cat([F.linear(x, self.kv_proj), F.linear(x, self.gate_proj)], dim=-1)
        for seq in seqs:
            self._compress(projected[seq.rows], seq, ring[seq.slot], cache, block_size, rope)

    def _compress(
        self,
        new: torch.Tensor,
        seq: SequenceRows,
        ring: torch.Tensor,
        cache: torch.Tensor,
        block_size: int,
        rope: TrailingRope,
    ) -> None:
        m, ring_len = self.ratio, self.coff * self.ratio
        p0, p1 = seq.first_position, seq.end_position
        first_window, end_window = p0 // m, p1 // m
        if end_window > first_window:
            # Tokens from the start of the window before the first closing one (CSA's Ca half) onwards.
            start = max(0, (first_window - self.coff + 1) * m)
            old = ring[torch.arange(start, p0, device=new.device) % ring_len]
            tokens = torch.cat([old, new], dim=0)
            windows = torch.arange(first_window, end_window, device=new.device)
            entries = self._pool(tokens, windows, start)
            entries = rope(entries, windows * m)
            slots = entry_slots(seq.block_table, windows, m, block_size, cache.shape[1])
            cache.flatten(0, 1).index_copy_(0, slots, entries.to(cache.dtype))
        keep = min(seq.length, ring_len)
        ring[torch.arange(p1 - keep, p1, device=new.device) % ring_len] = new[-keep:].to(ring.dtype)

    def _pool(self, tokens: torch.Tensor, windows: torch.Tensor, start: int) -> torch.Tensor:
        """Entries ``[len(windows), entry_dim]`` from ``tokens`` (raw projections of positions ``start``..)."""
        m, d = self.ratio, self.entry_dim
        kv, gate = tokens.split(self.coff * d, dim=-1)
        rows = windows[:, None] * m + torch.arange(m, device=tokens.device) - start  # [W, m]
        cur_kv, cur_gate = kv[rows], gate[rows] + self.position_bias
        if self.coff == 1:
            slot_kv, slot_gate = cur_kv, cur_gate
        else:
            # Window w-1's Ca half (first d channels) next to window w's Cb half; window 0 has no Ca.
            has_prev = (windows > 0)[:, None, None]
            prev = rows - m
            prev_kv = torch.where(has_prev, kv[prev.clamp(min=0)][..., :d], 0.0)
            prev_gate = (gate[prev.clamp(min=0)] + self.position_bias)[..., :d]
            prev_gate = prev_gate.masked_fill(~has_prev, float("-inf"))
            slot_kv = torch.cat([prev_kv, cur_kv[..., d:]], dim=1)
            slot_gate = torch.cat([prev_gate, cur_gate[..., d:]], dim=1)
        weights = torch.softmax(slot_gate, dim=1, dtype=torch.float32).to(slot_kv.dtype)
        return scaled_rms_norm((slot_kv * weights).sum(dim=1), self.kv_norm, self.eps)

    def load(self, weights: V4Weights, prefix: str) -> None:
        """``prefix`` is e.g. ``layers.3.attn.compressor.``."""
        named = [("wkv.weight", self.kv_proj), ("wgate.weight", self.gate_proj), ("ape", self.position_bias)]
        named.append(("norm.weight", self.kv_norm))
        with torch.no_grad():
            for name, target in named:
                target.copy_(weights.get(prefix + name, tuple(target.shape), target.dtype))
