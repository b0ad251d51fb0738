"""Multi-head latent attention (MLA), torch reference over a paged latent cache.

Per token the cache holds the compressed latent ``c = kv_a_layernorm(kv_a(x)[:rkv])`` and the roped
shared key ``k_pe`` (``rkv + dr`` values, the page tensor ``[blocks, block_size, rkv + dr]``), never
per-head K/V. Prefill segments expand the latents of their context into per-head keys and values through
``kv_b_proj``; decode rows use the absorbed form: the query's no-rope part goes through W_UK into latent
space, attention runs over the latents directly (an MQA with head size rkv + dr), and W_UV maps the
result back to per-head values (``mla_decode``: a Triton kernel on CUDA, its torch reference elsewhere).

The rope channels stay in the checkpoint's pairing (interleaved by default) for q and k alike.

DeepSeek-V3.2 adds a DSA lightning indexer (``indexer.py``) to every layer: it selects, per query, the
cached positions attention may use: prefill masks every other key, decode reads only the selected
latents (the kernel's sparse rows).

Tensor parallelism splits the heads: a rank holds its heads' rows of ``q_proj`` / ``q_b_proj`` and of
``kv_b_proj`` (each head's ``[nope | v]`` rows) and their columns of ``o_proj``, whose partial output is
all-reduced (its bias added once, after the sum). The down projections ``q_a_proj`` and
``kv_a_proj_with_mqa`` and their norms are replicated: the latent is the same on every rank, so each
rank's latent cache holds the whole latent (and the indexer, replicated too, sees the whole ``cq``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pegainfer import ops
from pegainfer.layers.attention import QUERY_BLOCK, AttentionMetadata, page_slots, query_block, write_rows
from pegainfer.layers.rotary_yarn import PairedRotaryEmbedding
from pegainfer.model.model_api import ForwardBatch
from pegainfer.parallel.distributed import TensorParallel
from pegainfer.parallel.sharding import split
from pegainfer_deepseek.config import DeepseekV3Dims
from pegainfer_deepseek.fp8 import WeightReader, load_projection
from pegainfer_deepseek.indexer import IndexSelection, LightningIndexer
from pegainfer_deepseek.latent_rope import latent_rope_
from pegainfer_deepseek.mla_decode import mla_decode_attention
from pegainfer_deepseek.params import param, projection


def prefill_scratch_bytes(dims: DeepseekV3Dims, num_heads: int, context: int, dtype_bytes: int) -> int:
    """A bound on what ``MLAttention``'s expanded prefill allocates for a segment of ``context`` tokens (the
    memory plan passes ``max_model_len``; segments run one at a time) with ``num_heads`` heads: the
    context's slots and gathered latents, its expanded keys and values, and one query block through SDPA's
    math path (taken with a boolean mask and keys wider than values), which for 16-bit inputs works in
    fp32: keys (and their scaled copy) and values upcast, the mask as floats, scores and probabilities of
    a block of queries (``query_block``) over the context (as torch 2.13's math path allocates them,
    measured by ``tests/test_deepseek_prefill_scratch.py``)."""
    nh, dn, dr, dv = num_heads, dims.qk_nope_head_dim, dims.qk_rope_head_dim, dims.v_head_dim
    block = query_block(context, QUERY_BLOCK)
    per_key = (
        2 * 8  # positions and slots, int64
        + (dims.kv_lora_rank + dr) * dtype_bytes  # gathered latents
        + nh * (dn + dv + dn + dr) * dtype_bytes  # kv_b_proj's keys and values, keys with the rope part
        + nh * (2 * (dn + dr) + dv) * 4  # fp32 keys, scaled keys, values
        # masks: causal, selected (booleans), in the queries' dtype and in fp32; per head: fp32 scores and
        # probabilities, a boolean of the fully masked rows, a 16-bit copy of the probabilities
        + block * (2 + 2 + 4 + nh * (4 + 4 + 1 + 2))
    )
    per_query = (
        nh * (2 * (dn + dr) + 2 * dv) * (dtype_bytes + 4)
    )  # a block's queries and outputs, both widths
    return context * per_key + block * per_query


class MLAttention(nn.Module):
    """``num_heads`` is this rank's share of the heads under tensor parallelism (``tp``)."""

    def __init__(self, dims: DeepseekV3Dims, dtype: torch.dtype, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.dims = dims
        self.tp = tp = tp or TensorParallel()
        self.num_heads = nh = tp.split(dims.num_heads, "num_attention_heads")
        h = dims.hidden_size
        rq, rkv, dr = dims.q_lora_rank, dims.kv_lora_rank, dims.qk_rope_head_dim
        q_out = nh * dims.qk_head_dim
        #: Rows of ``in_proj`` before the latent's: ``q_a_proj``'s, or ``q_proj``'s without a query LoRA.
        self.q_rows = q_out if rq is None else rq
        # q_a_proj (or q_proj) and kv_a_proj_with_mqa both read x: stacked, they are one GEMM, and the
        # thin kv_a (576 rows) no longer runs alone far below the read rate. With FP8 weights these and
        # q_b / o_proj stay float8 (``BlockFP8Weight``); kv_b_proj, whose halves the absorbed decode
        # multiplies per head, is dequantized.
        block = dims.fp8_block
        act8 = dims.fp8_activations
        self.in_proj = projection(self.q_rows + rkv + dr, h, dtype, block, fp8_activations=act8)
        if rq is not None:
            self.q_a_layernorm = param(rq, dtype=dtype)
            self.q_b_proj = projection(q_out, rq, dtype, block, fp8_activations=act8)
        self.kv_a_layernorm = param(rkv, dtype=dtype)
        self.kv_b_proj = param(nh * (dims.qk_nope_head_dim + dims.v_head_dim), rkv, dtype=dtype)
        o_cols = nh * dims.v_head_dim
        # A checkpoint's tiles need not start at this rank's first column; weights quantized at load are
        # tiled from it.
        offset = tp.rank * o_cols % block[1] if block is not None and dims.fp8 is not None else 0
        self.o_proj = projection(h, o_cols, dtype, block, offset, act8)
        biased = dims.attention_bias
        # q_a_proj and kv_a_proj_with_mqa carry the bias; q_proj has none (its rows' share stays zero).
        self.in_bias = param(self.q_rows + rkv + dr, dtype=dtype) if biased else None
        self.o_bias = param(h, dtype=dtype) if biased else None
        self.scale = dims.softmax_scale
        self.indexer = LightningIndexer(dims, dtype) if dims.indexer is not None else None

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        cache: torch.Tensor,
        rotary: PairedRotaryEmbedding,
        index_cache: torch.Tensor | None = None,
        index_rotary: PairedRotaryEmbedding | None = None,
    ) -> torch.Tensor:
        """Attention output ``[T, H]`` for the normed input ``x``; writes the tokens' latents to ``cache``.

        With an indexer (V3.2), ``index_cache`` is its key cache and ``index_rotary`` its half-split rope."""
        dims, eps, t = self.dims, self.dims.rms_norm_eps, x.shape[0]
        dn, dr = dims.qk_nope_head_dim, dims.qk_rope_head_dim
        selection = None
        q, latent = ops.linear(x, self.in_proj, self.in_bias).split(
            [self.q_rows, self.in_proj.shape[0] - self.q_rows], -1
        )
        if dims.q_lora_rank is not None:
            cq = ops.rms_norm(q, self.q_a_layernorm, eps)
            q = ops.linear(cq, self.q_b_proj)
            if self.indexer is not None:
                if index_cache is None or index_rotary is None:
                    raise ValueError("a DeepSeek-V3.2 layer needs its indexer cache and half-split rope")
                selection = self.indexer(x, cq, batch, index_cache, index_rotary)
        q = q.view(t, self.num_heads, dims.qk_head_dim)
        if ops.use_triton(latent):  # one launch for the rotary, the latent's norm and the cache write
            latent_rope_(
                q, latent, batch.positions, batch.attn.slot_mapping, cache, self.kv_a_layernorm, eps,
                rotary.cos, rotary.sin, rotary.interleaved,
            )  # fmt: skip
            q_nope, q_pe = q.split([dn, dr], dim=-1)
        else:
            q_nope, q_pe = self._prologue_ref(q, latent, batch, cache, rotary)
        out = q.new_empty(t, self.num_heads, dims.v_head_dim)
        self._prefill(q_nope, q_pe, cache, batch.attn, out, selection)
        self._decode(q_nope, q_pe, cache, batch.attn, out, selection)
        if self.tp.size == 1:
            return ops.linear(out.flatten(1), self.o_proj, self.o_bias)
        attn = self.tp.all_reduce(ops.linear(out.flatten(1), self.o_proj))
        return attn if self.o_bias is None else attn + self.o_bias

    def _prologue_ref(
        self,
        q: torch.Tensor,
        latent: torch.Tensor,
        batch: ForwardBatch,
        cache: torch.Tensor,
        rotary: PairedRotaryEmbedding,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The torch form of ``latent_rope_``: (q_nope, roped q_pe); the normed latent and roped k_pe are
        written to ``cache``."""
        dims = self.dims
        dn, dr, rkv = dims.qk_nope_head_dim, dims.qk_rope_head_dim, dims.kv_lora_rank
        q_nope, q_pe = q.split([dn, dr], dim=-1)
        c, k_pe = latent.split([rkv, dr], dim=-1)
        c = ops.rms_norm(c, self.kv_a_layernorm, dims.rms_norm_eps)
        q_pe, k_pe = rotary(batch.positions, q_pe, k_pe.unsqueeze(1))
        write_rows(cache, torch.cat([c, k_pe.squeeze(1)], dim=-1), batch.attn.slot_mapping)
        return q_nope, q_pe

    def _prefill(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        cache: torch.Tensor,
        meta: AttentionMetadata,
        out: torch.Tensor,
        selection: IndexSelection | None = None,
    ) -> None:
        """Expanded form: per-head keys ``[k_nope | k_pe]`` and values from each segment's cached latents,
        attended through ``scaled_dot_product_attention``."""
        dims = self.dims
        nh, dn, rkv = self.num_heads, dims.qk_nope_head_dim, dims.kv_lora_rank
        flat = cache.flatten(0, 1)
        for i, seg in enumerate(meta.prefills):
            positions = torch.arange(seg.ctx_len, device=q_nope.device)
            latent = flat[page_slots(seg.block_table, positions, meta.block_size)]  # [L, rkv + dr]
            c, k_pe = latent[:, :rkv], latent[:, rkv:]
            kv = F.linear(c, self.kv_b_proj).view(seg.ctx_len, nh, dn + dims.v_head_dim)
            k_nope, v = kv.split([dn, dims.v_head_dim], dim=-1)
            keys = torch.cat([k_nope, k_pe[:, None, :].expand(-1, nh, -1)], dim=-1)  # [L, nh, dn + dr]
            first = seg.ctx_len - seg.q_len
            # Query blocks: with a boolean mask and q/k wider than v, SDPA may take its math path, which
            # materialises [heads, queries, keys] scores (batch 32 x 4096-token prompts ran out of memory
            # on the H200 in one block); a block bounds them to query_block x context.
            block = query_block(seg.ctx_len, QUERY_BLOCK)
            for lo in range(0, seg.q_len, block):
                n = min(block, seg.q_len - lo)
                rows = slice(seg.q_start + lo, seg.q_start + lo + n)
                queries = torch.cat([q_nope[rows], q_pe[rows]], dim=-1)  # [n, nh, dn + dr]
                q_pos = positions[first + lo : first + lo + n]
                allowed = positions[None, :] <= q_pos[:, None]  # causal from the block's place in its context
                if selection is not None:
                    allowed = allowed & selection.prefill[i][lo : lo + n]
                attended = F.scaled_dot_product_attention(
                    queries.transpose(0, 1),
                    keys.transpose(0, 1),
                    v.transpose(0, 1),
                    attn_mask=allowed,
                    scale=self.scale,
                )
                out[rows] = attended.transpose(0, 1)

    def _decode(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        cache: torch.Tensor,
        meta: AttentionMetadata,
        out: torch.Tensor,
        selection: IndexSelection | None = None,
    ) -> None:
        """Absorbed form: scores ``(W_UKᵀ q_nope)·c + q_pe·k_pe`` over the latents, output ``W_UV p·c``
        (``mla_decode``: the Triton kernel on CUDA, its torch reference elsewhere)."""
        if not meta.num_decodes:
            return
        dims = self.dims
        nh, dn = self.num_heads, dims.qk_nope_head_dim
        rows = slice(meta.num_prefill_tokens, meta.num_prefill_tokens + meta.num_decodes)
        w_kv = self.kv_b_proj.view(nh, dn + dims.v_head_dim, dims.kv_lora_rank)
        w_uk, w_uv = w_kv[:, :dn], w_kv[:, dn:]
        # Batched over heads on the strided views as they are (no copies in or out; the attention takes
        # any row and head strides): q_latent [H, B, rkv] seen as [B, H, rkv].
        q_latent = torch.bmm(q_nope[rows].transpose(0, 1), w_uk).transpose(0, 1)
        o_latent = mla_decode_attention(
            q_latent, q_pe[rows], cache, meta.decode_block_tables,
            meta.decode_seq_lens, self.scale, max_seq_len=meta.max_decode_seq_len,
            indices=selection.decode if selection is not None else None,
        )  # fmt: skip
        out[rows] = torch.bmm(o_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    def load(self, reader: WeightReader, prefix: str) -> None:
        dims, p = self.dims, prefix + "self_attn."
        nh, h = dims.num_heads, dims.hidden_size
        q_out, kv_out = nh * dims.qk_head_dim, nh * (dims.qk_nope_head_dim + dims.v_head_dim)
        heads, columns = split(0), split(1)  # by heads: each head's rows (columns of o_proj) contiguous
        # (name, parameter, full shape, shard rule); None shape: replicated, the parameter's own.
        lora = dims.q_lora_rank is not None
        q_rows, latent_rows = slice(0, self.q_rows), slice(self.q_rows, self.in_proj.shape[0])
        bias = self.in_bias
        latent = (self.in_proj.shape[0] - self.q_rows, h)
        if lora:
            load_projection(reader, self.in_proj, p + "q_a_proj.weight", (self.q_rows, h), rows=q_rows)
            load_projection(reader, self.q_b_proj, p + "q_b_proj.weight", (q_out, dims.q_lora_rank), heads)
        else:
            load_projection(reader, self.in_proj, p + "q_proj.weight", (q_out, h), heads, rows=q_rows)
        load_projection(reader, self.in_proj, p + "kv_a_proj_with_mqa.weight", latent, rows=latent_rows)
        load_projection(reader, self.o_proj, p + "o_proj.weight", (h, nh * dims.v_head_dim), columns)

        def rows_of(t: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
            return None if t is None else t[rows]

        named = [
            ("q_a_proj.bias", rows_of(bias, q_rows) if lora else None, None, None),
            ("q_a_layernorm.weight", getattr(self, "q_a_layernorm", None), None, None),
            ("kv_a_proj_with_mqa.bias", rows_of(bias, latent_rows), None, None),
            ("kv_a_layernorm.weight", self.kv_a_layernorm, None, None),
            ("kv_b_proj.weight", self.kv_b_proj, (kv_out, dims.kv_lora_rank), heads),
            ("o_proj.bias", self.o_bias, None, None),
        ]
        with torch.no_grad():
            if bias is not None and not lora:
                bias[q_rows].zero_()  # q_proj has no bias
            for name, target, shape, shard in named:
                if target is not None:
                    full = tuple(target.shape) if shape is None else shape
                    target.copy_(reader.get(p + name, full, target.dtype, shard))
        if self.indexer is not None:
            self.indexer.load(reader, prefix)
