"""Prompt lookup (``speculative.method=ngram``): a request's drafts are the tokens that followed the latest
earlier occurrence of its last ``n`` tokens, for the longest ``n`` in ``[n_min, n_max]`` that occurs.

It pays where answers repeat their context (code edits, quoting a document, structured rewrites) and
costs one verification row a draft elsewhere. The search runs on the host over a per-request copy of the
tokens kept as an int array (appended to, never rebuilt), vectorised: a step scans the sequence once
per request (its cost grows with the length), and does no device work.
"""

from __future__ import annotations

import numpy as np


class PromptLookup:
    """One request's token array and its lookup; ``drafts`` is called with the request's tokens so far
    (which only ever grow)."""

    def __init__(self, n_min: int, n_max: int) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got {n_min}, {n_max}")
        self.n_min, self.n_max = n_min, n_max
        self._tokens = np.empty(256, dtype=np.int64)
        self._len = 0

    def _sync(self, tokens: list[int]) -> np.ndarray:
        total = len(tokens)
        if total > self._tokens.shape[0]:
            grown = np.empty(max(total, 2 * self._tokens.shape[0]), dtype=np.int64)
            grown[: self._len] = self._tokens[: self._len]
            self._tokens = grown
        if total > self._len:
            self._tokens[self._len : total] = tokens[self._len :]
            self._len = total
        return self._tokens[:total]

    def drafts(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest matching suffix
        (fewer where that occurrence is near the end; none when no suffix of ``n_min`` tokens recurs)."""
        seq = self._sync(tokens)
        total = seq.shape[0]
        if k <= 0:
            return []
        for n in range(min(self.n_max, total - 1), self.n_min - 1, -1):
            suffix = seq[total - n :]
            # Starts of earlier occurrences: at least one token must follow each (start + n < total).
            starts = np.flatnonzero(seq[: total - n] == suffix[0])
            for j in range(1, n):
                if starts.size == 0:
                    break
                starts = starts[seq[starts + j] == suffix[j]]
            if starts.size:
                after = int(starts[-1]) + n
                return seq[after : after + k].tolist()
        return []
