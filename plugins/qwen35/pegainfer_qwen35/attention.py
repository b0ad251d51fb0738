"""Qwen3.5's gated full attention (the ``full_attention`` layers), over the paged KV cache.

``q_proj`` yields, per head, the query (first head_dim channels) and an output gate (next head_dim):
not two halves of the whole projection. q and k get zero-centred ``(1 + w)`` RMSNorms per head, then
partial half-split rotary on their first ``rotary_dim`` channels; causal GQA with scale head_dim^-0.5;
the output is multiplied by ``sigmoid(gate)`` before ``o_proj``.

On CUDA a step of decode rows only runs all of that between the two projections in the decode attention's
two kernels (``paged_decode_attention`` with a zero-centred ``DecodeRope`` and the ``gate``), where the
torch sequence took some twenty launches a layer; any other batch norms, rotates and gates around the
paged attention.

Tensor parallelism splits it by heads: ``q_proj``'s rows are head-major, so an even split gives each rank
whole heads with their own gates; key/value heads are split too, or replicated over consecutive ranks when
there are fewer than ranks (each rank's query heads are exactly the ones its kv head serves); the q/k norms
are replicated; ``o_proj`` is row-parallel and its partial output is all-reduced in place. The KV cache
holds the rank's kv heads.
"""

from __future__ import annotations

import torch
from torch import nn

from pegainfer.layers.rotary import RotaryEmbedding
from pegainfer.memory.buffer_specs import PagedKVSpec
from pegainfer.model.checkpoint import CheckpointReader
from pegainfer.model.model_api import ForwardBatch
from pegainfer.ops import paged_attention, use_triton, write_kv
from pegainfer.parallel.distributed import TensorParallel
from pegainfer.parallel.sharding import Shard, split
from pegainfer_qwen35.config import Qwen35Config, Qwen35Shard
from pegainfer_qwen35.norms import rms_norm_zero_centred
from pegainfer_qwen35.pass_buffers import PassBuffers
from pegainfer_qwen35.projections import FoldedNorm, project, project_add


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class GatedAttention(nn.Module):
    def __init__(
        self,
        config: Qwen35Config,
        layer_index: int,
        dtype: torch.dtype,
        shard: Qwen35Shard | None = None,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.layer_index = layer_index
        self.tp = tp or TensorParallel()
        self.shard = s = shard or Qwen35Shard.of(config, self.tp)
        d = config.head_dim
        self.q_size, self.kv_size = s.num_heads * d, s.num_kv_heads * d  # this rank's heads
        self.qkv_proj = _param(2 * self.q_size + 2 * self.kv_size, config.hidden_size, dtype=dtype)
        self.q_norm = _param(d, dtype=dtype)
        self.k_norm = _param(d, dtype=dtype)
        self.o_proj = _param(config.hidden_size, self.q_size, dtype=dtype)
        self.scale = d**-0.5

    def cache_spec(self) -> PagedKVSpec:
        return PagedKVSpec(
            self.layer_index, self.shard.num_kv_heads, self.config.head_dim, self.qkv_proj.dtype
        )

    @property
    def first_projection(self) -> torch.Tensor:
        """The projection of the layer's input rows (``qkv_proj``), which carries the input norm folded in."""
        return self.qkv_proj

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        cache: torch.Tensor,
        rotary: RotaryEmbedding,
        bufs: PassBuffers,
        residual: torch.Tensor | None = None,
        norm: FoldedNorm | None = None,
    ) -> torch.Tensor:
        """Mixer output of the normed rows ``x`` ``[T, H]`` (with ``norm``: of the un-normed rows, the
        norm folded into ``qkv_proj``; into ``bufs.mixer_out`` on the reference path); writes K/V pages.
        With ``residual`` the output is added to it in place and returned."""
        c, t = self.config, x.shape[0]
        nq, nkv, d, eps = self.shard.num_heads, self.shard.num_kv_heads, c.head_dim, c.rms_norm_eps
        qkv = project(x, self.qkv_proj, bufs.attn_qkv, norm)
        query_gate, k, v = qkv.split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        query, gate = query_gate.view(t, nq, 2 * d).split(d, dim=-1)
        meta = batch.attn
        if use_triton(x) and meta.num_decodes and not meta.prefills:
            from pegainfer.kernels import paged_decode_attention as decode

            rope = decode.DecodeRope(
                k.view(t, nkv, d), v.view(t, nkv, d), self.q_norm, self.k_norm, rotary, batch.positions,
                meta.slot_mapping, eps, zero_centred=True,
            )  # fmt: skip
            gated = decode.paged_decode_attention(
                query, cache, meta.decode_block_tables, meta.decode_seq_lens, self.scale,
                out=bufs.attn_out.view(t, nq, d), max_seq_len=meta.max_decode_seq_len, rope=rope, gate=gate,
            ).view(t, self.q_size)  # fmt: skip
            return self._project_out(gated, bufs, residual)
        q = rms_norm_zero_centred(query, self.q_norm, eps)
        k = rms_norm_zero_centred(k.view(t, nkv, d), self.k_norm, eps)
        q, k = rotary(batch.positions, q, k)
        q = bufs.attn_q.view(t, nq, d).copy_(q)
        k = bufs.attn_k.view(t, nkv, d).copy_(k)
        write_kv(cache, k, v.view(t, nkv, d), batch.attn.slot_mapping)
        o = paged_attention(q, cache, batch.attn, self.scale)
        gated = torch.mul(
            o.view(t, self.q_size), torch.sigmoid(gate).reshape(t, self.q_size), out=bufs.attn_out
        )
        return self._project_out(gated, bufs, residual)

    def _project_out(
        self, gated: torch.Tensor, bufs: PassBuffers, residual: torch.Tensor | None
    ) -> torch.Tensor:
        if residual is not None:
            return project_add(gated, self.o_proj, residual, bufs.mixer_out, self.tp)
        return self.tp.all_reduce(project(gated, self.o_proj, bufs.mixer_out))  # row-parallel partials

    def load(self, reader: CheckpointReader, prefix: str) -> None:
        c, dtype = self.config, self.qkv_proj.dtype
        h, d = c.hidden_size, c.head_dim
        q, kv = c.num_heads * d, c.num_kv_heads * d  # the checkpoint's full sizes
        # q_proj's rows are head-major ([query | gate] per head): an even split is whole heads with their
        # gates. k/v: as many pieces as there are distinct kv shards. o_proj: the matching input columns.
        heads, kv_heads, columns = split(0), split(0, self.shard.kv_pieces), split(1)

        def get(name: str, shape: tuple[int, ...], shard: Shard | None = None) -> torch.Tensor:
            return reader.get(prefix + name, shape, dtype, shard)

        with torch.no_grad():
            self.qkv_proj.copy_(
                torch.cat(
                    [
                        get("q_proj.weight", (2 * q, h), heads),
                        get("k_proj.weight", (kv, h), kv_heads),
                        get("v_proj.weight", (kv, h), kv_heads),
                    ]
                )
            )
            self.q_norm.copy_(get("q_norm.weight", (d,)))
            self.k_norm.copy_(get("k_norm.weight", (d,)))
            self.o_proj.copy_(get("o_proj.weight", (h, q), columns))
