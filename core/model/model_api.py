"""What a model plugin's class implements, and the batch it is handed.

A model file reads like the architecture: ``forward`` maps a flat batch of tokens to hidden states using
the caches the BufferManager owns; ``compute_logits`` is separate so only the rows that sample pay for
the vocabulary projection. Device and kernel choices live in the layers, not here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from pegainfer.config.schema import ModelConfig
from pegainfer.layers.attention import AttentionMetadata
from pegainfer.memory.buffer_specs import BufferSpec, CacheKey, TransientSpec
from pegainfer.model.checkpoint import CheckpointReader


@dataclass
class StateCheckpoints:
    """Recurrent-state snapshots a forward takes inside its prefill segments (only for a model with
    ``snapshot_inside_chunk_tokens``): for ``j < counts[i]``, segment ``i``'s state after its first
    ``tokens[i] + j`` tokens (``tokens[i] = -1``: none) is copied into snapshot slot ``slots[i] + j`` of
    ``pools``, the snapshot tensors of each state layer (the same names and shapes per slot as
    ``states``). Prefix caching takes one (count 1) at a page boundary; speculative decoding takes one
    after each token a rejection may roll the state back to (``docs/speculative.md``)."""

    tokens: torch.Tensor  # [num_segments] int64, on the device
    slots: torch.Tensor  # [num_segments] int64, on the device
    counts: torch.Tensor  # [num_segments] int64, on the device
    host: list[tuple[int, int, int]]  # the same (tokens, slot, count) per segment on the host
    pools: dict[int, dict[str, torch.Tensor]]


@dataclass
class ForwardBatch:
    """Device tensors of one step. Tokens are laid out prefill segments first, then decode rows."""

    token_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn: AttentionMetadata
    state_slots: torch.Tensor | None = None  # [num_requests] recurrent-state slot per segment/row
    hidden_states: torch.Tensor | None = None  # [T, H], for models that do not embed on the device
    checkpoints: StateCheckpoints | None = None


class CausalLM(torch.nn.Module, ABC):
    """The contract between the core and a model plugin.

    Construction happens on the target device with the compute dtype; ``load_weights`` then fills every
    parameter from the checkpoint (raising CheckpointError naming a missing or mis-shaped tensor).
    """

    #: Whether ``forward`` embeds ``token_ids`` itself; False means the engine passes ``hidden_states``.
    embeds_on_device: bool = True
    #: Whether decode-only steps may replay as CUDA graphs (on CUDA, unless ``enforce_eager``): the decode
    #: path makes no host sync and takes its shapes only from the batch size and the static bounds
    #: (``AttentionMetadata.max_decode_seq_len`` is ``max_model_len`` there). A model that does not embed
    #: on the device gets its ``embed`` captured inside the graph, on the graph's token-id buffer.
    decode_graphs: bool = True
    #: Why this model cannot reuse cached prefix pages (None: it can). Prefix caching shares a full page
    #: between requests with the same tokens up to it, restoring recurrent state (``RecurrentStateSpec``
    #: slots) from a snapshot taken at a page boundary: a model whose full pages are still written later,
    #: or whose state lives anywhere but its slots, says why here and runs uncached.
    prefix_caching_refusal: str | None = None
    #: Prefix caching of recurrent state: a prefill chunk of at most this many tokens may cross one snapshot
    #: boundary instead of being cut there, the forward saving the state at it (``ForwardBatch.checkpoints``).
    #: 0: every chunk ends at the boundaries it would cross, and the state is copied after the forward.
    snapshot_inside_chunk_tokens: int = 0
    #: The most tokens of a prefill-only step this model's forward runs inside a CUDA graph (0: none). Such
    #: a forward gets ``AttentionMetadata.in_graph`` batches: it reads the segments only from their device
    #: form, with no host sync and no shape that depends on the segments' values.
    prefill_graph_tokens: int = 0
    #: Tokens a KV page holds when ``cache.block_size`` is not set: the page size the model's attention
    #: kernels run best with.
    default_block_size: int = 16

    @property
    def vocab_size(self) -> int:
        """Columns of the logits: the memory plan reserves the sampler's and the graphs' logits by it
        (a model that leaves it 0 gets no such reserve)."""
        return 0

    @property
    def hidden_size(self) -> int:
        """Width of the final hidden states ``forward`` returns: the memory plan reserves the prefill and
        draft graphs' hidden-state outputs by it (a model that leaves it 0 gets no such reserve)."""
        return 0

    @classmethod
    @abstractmethod
    def from_hf_config(
        cls, hf_config: dict[str, Any], model_config: ModelConfig, *, dtype: torch.dtype, max_model_len: int
    ) -> CausalLM:
        """Build the (uninitialised) module for ``hf_config`` (config.json as a dict).

        ``model_config`` is an instance of the plugin's ``config_schema`` (``ModelConfig`` without one).
        A model that shards declares a keyword-only ``tp: TensorParallel`` too (this rank's place in its
        group); one whose signature has no ``tp`` is refused at tensor-parallel size > 1. A model with draft
        (MTP) modules declares a keyword-only ``drafting: bool`` too: whether the engine speculates
        (``speculative.num_tokens > 0``); without drafting it builds none, so a run that does not draft
        holds no memory for them, and its loader skips the checkpoint's draft tensors."""

    @staticmethod
    @abstractmethod
    def max_context_length(hf_config: dict[str, Any]) -> int:
        """The longest context the checkpoint supports (``max_position_embeddings``)."""

    @abstractmethod
    def load_weights(self, reader: CheckpointReader) -> None:
        """Copy every parameter from ``reader`` (packing fused projections as needed)."""

    @abstractmethod
    def buffer_specs(self) -> list[BufferSpec]:
        """Per-layer cache and state needs, in the model's compute dtype."""

    def transient_specs(self) -> list[TransientSpec]:
        """Scratch memory a step needs, reserved by the memory plan before pages are sized."""
        return []

    @abstractmethod
    def forward(
        self,
        batch: ForwardBatch,
        caches: dict[CacheKey, torch.Tensor],
        states: dict[int, dict[str, torch.Tensor]],
    ) -> torch.Tensor:
        """Final hidden states ``[T, H]`` (after the last norm) for every token of ``batch``."""

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits ``[N, V]`` for the given rows of hidden states."""

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Input embeddings, which the model runner puts into ``batch.hidden_states`` for models with
        ``embeds_on_device = False``."""
        raise NotImplementedError(f"{type(self).__name__} embeds on the device; embed() is not offered")

    def input_embeddings(self, token_ids: torch.Tensor) -> torch.Tensor | None:
        """What the runner passes as ``ForwardBatch.hidden_states`` for ``token_ids``: None for a model that
        embeds on the device, else ``embed(token_ids)``."""
        return None if self.embeds_on_device else self.embed(token_ids)

    # ------------------------------------------------------------------------------------- drafting
    # Speculative decoding with the model's own draft (MTP) modules (``speculative.num_tokens=k``): a model
    # that drafts overrides all three; docs/speculative.md describes how the engine uses them.

    @property
    def num_mtp_layers(self) -> int:
        """Draft modules loaded (0: the model does not draft; a checkpoint may have stripped them)."""
        return 0

    def mtp_buffer_specs(self) -> list[BufferSpec]:
        """The caches of the draft modules, module by module (a module's main cache and any named ones of
        its layer; not part of ``buffer_specs``: a run that does not draft does not pay for them)."""
        return []

    def mtp_forward(
        self,
        hidden_states: torch.Tensor,
        next_token_ids: torch.Tensor,
        batch: ForwardBatch,
        caches: dict[CacheKey, torch.Tensor],
        *,
        depth: int = 0,
        return_hidden: bool = False,
        logit_rows: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Draft logits ``[T, V]`` (float32) of draft module ``depth`` for the token after next: row r pairs
        the main model's final hidden state at ``batch.positions[r]`` with ``next_token_ids[r]``, the token
        at the following position, and writes the module's cache there. ``return_hidden``: also the module's
        output hidden states (every row), the input of a further chained draft; ``logit_rows``: logits of
        those rows only."""
        raise NotImplementedError(f"{type(self).__name__} has no draft modules")
