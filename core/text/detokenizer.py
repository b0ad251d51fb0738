"""Incremental detokenization with stop strings: O(1) work per generated token, never half a character."""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence

from pegainfer.text.tokenizer import Tokenizer

_REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded before the output, so tokenizers whose decoders drop a leading space at the
# start of a decode (SentencePiece) still produce the first output word's space.
_PROMPT_CONTEXT_TOKENS = 5
# Text still ending in U+FFFD after this many held tokens, with another U+FFFD before it, is invalid UTF-8
# (a model emitting stray bytes); emitting it then keeps the decode window, and the work per token, bounded.
_MAX_HELD_TOKENS = 8
# Bound of each tokenizer's cache of single-token texts (a vocabulary's worth).
_MAX_CACHED_TOKENS = 1 << 18
_TOKEN_TEXTS: weakref.WeakKeyDictionary[object, dict[tuple[bool, bool], dict[int, str]]] = (
    weakref.WeakKeyDictionary()
)


def _token_texts(tokenizer: Tokenizer, skip_special_tokens: bool, complete: bool = False) -> dict[int, str]:
    """The shared cache of ``tokenizer.decode([id], skip_special_tokens)`` by id; with ``complete``, the
    one of the texts that are whole characters (see ``IncrementalDetokenizer._complete_text``)."""
    try:
        per_kind = _TOKEN_TEXTS.setdefault(tokenizer, {})
    except TypeError:  # not weakly referenceable: a private cache
        per_kind = {}
    return per_kind.setdefault((skip_special_tokens, complete), {})


class IncrementalDetokenizer:
    """Turns one request's generated token ids into text as they arrive, and watches for stop strings.

    Committed text is split into `_frozen` pieces, which no stop string can cut into any more, and a short
    `_tail` of the last characters, which a stop string completed later may still remove and which
    `get_delta` therefore holds back. Only `_frozen` grows with the output; ids are kept for a short window.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Iterable[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        # Straight into the tokenizer library (the window is always a list): decoding runs per token.
        self._decode = tokenizer.decoder(skip_special_tokens)
        # Texts of single tokens, shared by every detokenizer of this tokenizer (see _prefix_length).
        self._token_texts = _token_texts(tokenizer, skip_special_tokens)
        # The same for the tokens whose text is whole characters and that decode does not drop: what
        # update_one's common case looks up (byte-level decoders only; empty otherwise).
        self._complete_texts = _token_texts(tokenizer, skip_special_tokens, complete=True)
        # Byte-level decoders concatenate: after a token whose text is complete characters, a token whose
        # text alone is complete characters adds exactly that text, so update_one looks it up instead of
        # decoding (the common case of a generated token).
        self._concatenates = tokenizer.decodes_by_concatenation
        # Tokens that decode drops anyway are never stored, so runs of them cannot widen the decode window.
        self._dropped_ids = tokenizer.all_special_ids if skip_special_tokens else frozenset()
        self._stop = tuple(dict.fromkeys(s for s in stop if s))
        self._include_stop = include_stop_str_in_output
        max_stop_len = max((len(s) for s in self._stop), default=0)
        # A stop string completed by new text starts at most max_stop_len - 1 characters before it.
        self._search_context_len = max(max_stop_len - 1, 0)
        self._holdback = 0 if include_stop_str_in_output else self._search_context_len

        context = self._kept(prompt_token_ids[-4 * _PROMPT_CONTEXT_TOKENS :])[-_PROMPT_CONTEXT_TOKENS:]
        if context and self._decode(context).endswith(_REPLACEMENT_CHAR):
            # A prompt ending mid-character would make the first output text misaligned against it.
            context = []
        # The decode window: `_ids[:_read_offset]` is context already in the text, the rest is new.
        self._ids = context
        self._read_offset = len(context)
        # len(decode(_ids[:_read_offset])), kept while the window's context stays the same (None: unknown).
        self._prefix_len: int | None = None
        # The decoder is byte-level and the context decodes to whole characters (no U+FFFD): the text after
        # it is the new tokens' own (see update_one). False while _prefix_len is None.
        self._clean_prefix = False

        self._frozen: list[str] = []
        self._tail = ""
        self._search_context = ""
        self._num_streamed = 0  # pieces of _frozen already returned by get_delta
        self.stop_str: str | None = None
        """The stop string that ended the output, once one has matched."""

    @property
    def stable_text(self) -> str:
        """The text no later token can change: ``output_text`` without the tail held back in case a stop
        string is still forming."""
        return "".join(self._frozen)

    @property
    def output_text(self) -> str:
        """All text committed so far (after stop truncation). Builds a new string: stream with get_delta."""
        return "".join(self._frozen) + self._tail

    def update(self, new_token_ids: Sequence[int], *, check_stop: bool = True) -> str | None:
        """Add generated tokens; return the stop string if one is now complete (the text is cut there).

        ``check_stop=False`` (before a request's ``min_tokens``) adds the text without acting on a match.
        """
        self._add(new_token_ids)
        return self._emit(self._decode_new(final=False), check_stop)

    def update_one(self, token_id: int, check_stop: bool = True) -> str | None:
        """``update((token_id,), check_stop=check_stop)``, without the generality (every decode step
        calls it for every request)."""
        text = self._complete_texts.get(token_id)
        if text is not None and len(self._ids) == self._read_offset and self.stop_str is None:
            # The common case (see below), first and inline: a whole-character token after whole characters.
            self._ids, self._read_offset = [token_id], 1
            self._prefix_len, self._clean_prefix = len(text), True
            if self._stop:
                return self._commit(text, check_stop)
            self._frozen.append(text)
            return None
        if self.stop_str is not None:
            raise self._finished_error()
        if token_id in self._dropped_ids:
            return None  # nothing new: decode drops it
        ids, offset = self._ids, self._read_offset
        if self._concatenates:
            # A byte-level decoder's UTF-8 resynchronizes after whole characters and at a token that is whole
            # characters on its own: from there the new tokens' text is their own decode, whatever the
            # context (one token's is looked up).
            if len(ids) == offset:
                text = self._complete_text(token_id)
                if text is not None:  # the common case: the token's text, emitted at once
                    self._ids, self._read_offset = [token_id], 1
                    self._prefix_len, self._clean_prefix = len(text), True
                    return self._emit(text, check_stop)
                if self._clean_prefix:
                    own = self._token_text(token_id)
                    if not own or own.endswith(_REPLACEMENT_CHAR):
                        # The first bytes of a character, or nothing visible: held, as _new_text holds them.
                        ids.append(token_id)
                        return None
            ids.append(token_id)
            if self._clean_prefix or self._complete_text(ids[offset]) is not None:
                new_text = (
                    self._token_text(token_id) if len(ids) - offset == 1 else self._decode(ids[offset:])
                )
                return self._emit(self._new_text(new_text, final=False, own=True), check_stop)
        else:
            ids.append(token_id)
        new_text = self._decode(self._window())[self._prefix_len :]
        return self._emit(self._new_text(new_text, final=False), check_stop)

    def _token_text(self, token_id: int) -> str:
        """``decode([token_id])``, from the cache shared by this tokenizer's detokenizers."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._decode([token_id])
            if len(self._token_texts) < _MAX_CACHED_TOKENS:
                self._token_texts[token_id] = text
        return text

    def _complete_text(self, token_id: int) -> str | None:
        """The token's text when it is whole characters on its own (not empty, no U+FFFD), else None."""
        text = self._token_text(token_id)
        if not text or _REPLACEMENT_CHAR in text:
            return None
        if token_id not in self._dropped_ids and len(self._complete_texts) < _MAX_CACHED_TOKENS:
            self._complete_texts[token_id] = text
        return text

    def _add(self, new_token_ids: Sequence[int]) -> None:
        if self.stop_str is not None:
            raise self._finished_error()
        ids, dropped = self._ids, self._dropped_ids
        for token_id in new_token_ids:
            if token_id not in dropped:
                ids.append(token_id)

    def _finished_error(self) -> RuntimeError:
        return RuntimeError(f"update() after stop string {self.stop_str!r} matched; the request is finished")

    def _emit(self, text: str, check_stop: bool) -> str | None:
        if not text:
            return None
        if not self._stop:  # no stop strings: nothing is held back, every piece is final at once
            self._frozen.append(text)
            return None
        return self._commit(text, check_stop)

    def finish(self) -> None:
        """The request ended: decode tokens still waiting for the rest of a character as they are (as a
        full decode would, with U+FFFD) and release the held-back tail. Idempotent."""
        if self.stop_str is None:
            text = self._decode_new(final=True)
            if text:
                self._commit(text)
        if self._tail:
            self._frozen.append(self._tail)
            self._tail = ""

    def get_delta(self, finished: bool) -> str:
        """Text not returned by earlier calls; holds back a possible stop-string prefix until `finished`,
        which calls ``finish()`` and returns everything left."""
        if finished:
            self.finish()
        delta = "".join(self._frozen[self._num_streamed :])
        self._num_streamed = len(self._frozen)
        return delta

    def _kept(self, ids: Sequence[int]) -> list[int]:
        return [i for i in ids if i not in self._dropped_ids]

    def _decode_new(self, *, final: bool) -> str:
        """Text of the tokens after the read offset, decoded with a few earlier tokens as context."""
        window = self._window()
        if window is None:
            return ""
        return self._new_text(self._decode(window)[self._prefix_len :], final=final, own=self._clean_prefix)

    def _window(self) -> list[int] | None:
        """The ids to decode for the text after the read offset (None: nothing new), the context first;
        the context's own text length is known once this returns."""
        ids, offset = self._ids, self._read_offset
        if offset == len(ids):
            return None
        if self._prefix_len is None:
            # After each emitted token the context is that one token: its text is looked up.
            text = self._token_texts.get(ids[0]) if offset == 1 else None
            if text is None:
                text = self._prefix_text()
            self._prefix_len = len(text)
            self._clean_prefix = self._concatenates and _REPLACEMENT_CHAR not in text
        return ids

    def _new_text(self, new_text: str, *, final: bool, own: bool = False) -> str:
        """The new tokens' text (what follows the context's in the decode of :meth:`_window`'s ids) as it
        may be emitted; "" while it is held back. ``own``: ``new_text`` is the new tokens' decode alone."""
        ids, offset = self._ids, self._read_offset
        held = len(ids) - offset
        if not final and held < _MAX_HELD_TOKENS and (not new_text or new_text.endswith(_REPLACEMENT_CHAR)):
            # Nothing visible yet, or a multi-byte character is still arriving: wait rather than emit U+FFFD.
            return ""
        if not final and new_text.endswith(_REPLACEMENT_CHAR) and _REPLACEMENT_CHAR not in new_text[:-1]:
            # Still a single character arriving: tokens can each end one character and start the next,
            # so a long wait alone proves nothing; other U+FFFD before it would mean invalid bytes.
            return ""
        self._ids = ids[offset:]
        self._read_offset = len(self._ids)
        # The emitted tokens are the next context: its text is known when new_text is theirs alone.
        self._prefix_len = len(new_text) if own else None
        self._clean_prefix = own and _REPLACEMENT_CHAR not in new_text
        return new_text

    def _prefix_text(self) -> str:
        """decode(_ids[:_read_offset]); a single token's text is remembered for every detokenizer of this
        tokenizer (a decode is a pure function of its ids)."""
        offset = self._read_offset
        text = self._decode(self._ids[:offset])
        if offset == 1 and len(self._token_texts) < _MAX_CACHED_TOKENS:
            self._token_texts[self._ids[0]] = text
        return text

    def _commit(self, text: str, check_stop: bool = True) -> str | None:
        """Append decoded text, cut it at the earliest stop string, and return that stop string."""
        if self._stop:
            searched = self._search_context + text
            matches = [(i + len(s), i, s) for s in self._stop if check_stop and (i := searched.find(s)) != -1]
            if matches:
                # The stop string completed first wins, whatever way the text was split into updates.
                end, start, stop = min(matches)
                drop = len(searched) - (end if self._include_stop else start)
                if drop > len(text):
                    # The cut reaches back into the held-back tail, never further (see _holdback).
                    self._tail = self._tail[: len(self._tail) - (drop - len(text))]
                text = text[: max(len(text) - drop, 0)]
                self.stop_str = stop
            context = self._search_context + text
            self._search_context = context[max(len(context) - self._search_context_len, 0) :]
        tail = self._tail + text
        split = max(len(tail) - self._holdback, 0)
        if split:
            self._frozen.append(tail[:split])
        self._tail = tail[split:]
        return self.stop_str
