"""Shard rules: which part of a checkpoint tensor one tensor-parallel rank reads.

A plugin declares a rule per tensor where it reads the tensor (``CheckpointReader.get(..., shard=...)``);
the reader then reads only the rank's slices from the safetensors file, never the whole tensor.

Along ``dim`` the tensor is a concatenation of segments (one segment: the whole dimension). Each segment
is cut into ``pieces`` equal parts, and rank ``r`` of ``size`` takes part ``r * pieces // size`` of
every segment, stitched in order. ``pieces`` is the tensor-parallel size for a plain split; fewer pieces
than ranks replicate each piece over ``size / pieces`` consecutive ranks (key/value heads fewer than
ranks). The usual rules:

- column-parallel linear (output features split): ``split(0)``; packed projections whose parts must be
  split separately (Qwen3.5's q|k|v): ``stitch(0, q, k, v)``;
- row-parallel linear (input features split; an all-reduce follows): ``split(1)``;
- vocab-parallel embedding and lm_head: ``vocab_split()``, whose rows are padded with zeros to
  ``vocab_shard(vocab, size)`` per rank when the ranks do not divide the vocabulary;
- replicated tensors (norms, routers): no rule.
"""

from __future__ import annotations

from dataclasses import dataclass

from pegainfer.errors import CheckpointError


@dataclass(frozen=True)
class Shard:
    """See the module docstring. ``segments`` are (size, pieces) pairs; None is one segment spanning the
    dimension, cut into ``pieces`` (None: one piece per rank)."""

    dim: int
    segments: tuple[tuple[int, int | None], ...] | None = None
    pieces: int | None = None
    #: One whole-dim segment cut into ``ceil(length / size)``-sized parts, the last one short (the reader
    #: pads it with zeros): vocab-parallel tensors.
    padded: bool = False

    def ranges(self, length: int, rank: int, size: int, name: str) -> list[tuple[int, int]]:
        """The ``[start, stop)`` ranges of ``dim`` (of ``length``) that rank ``rank`` of ``size`` reads."""
        if self.padded:
            part = vocab_shard(length, size)
            return [(min(rank * part, length), min((rank + 1) * part, length))]
        segments = self.segments if self.segments is not None else ((length, self.pieces),)
        if sum(s for s, _ in segments) != length:
            raise CheckpointError(
                f"tensor '{name}': its dim {self.dim} has {length} entries, but the shard rule's segments "
                f"sum to {sum(s for s, _ in segments)}"
            )
        out, offset = [], 0
        for seg_size, seg_pieces in segments:
            pieces = size if seg_pieces is None else seg_pieces
            if seg_size % pieces or (pieces < size and size % pieces) or pieces > size:
                raise CheckpointError(
                    f"tensor '{name}': a segment of {seg_size} along dim {self.dim} cannot be cut into "
                    f"{pieces} pieces for tensor-parallel size {size}"
                )
            part = seg_size // pieces
            piece = rank * pieces // size
            out.append((offset + piece * part, offset + (piece + 1) * part))
            offset += seg_size
        return out


def split(dim: int, pieces: int | None = None) -> Shard:
    """The whole of ``dim`` cut into ``pieces`` parts (None: one per rank)."""
    return Shard(dim, pieces=pieces)


def stitch(dim: int, *segments: int | tuple[int, int]) -> Shard:
    """``dim`` as consecutive segments, each cut separately: a size (one piece per rank) or a
    (size, pieces) pair."""
    return Shard(dim, tuple(s if isinstance(s, tuple) else (s, None) for s in segments))


def vocab_split() -> Shard:
    """Rows of a vocab-parallel embedding or lm_head: ``vocab_shard(vocab, size)`` per rank, zero-padded."""
    return Shard(0, padded=True)


def vocab_shard(vocab_size: int, size: int) -> int:
    """Rows of a vocab-parallel embedding or lm_head per rank: the vocabulary padded to a multiple of the
    ranks (the padding rows are zeros and their logits are cut off after the gather)."""
    return -(-vocab_size // size)
