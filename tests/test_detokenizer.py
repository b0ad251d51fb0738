"""IncrementalDetokenizer: streamed text equals a full decode, never shows half a character or a stop string."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from pegainfer.text.detokenizer import IncrementalDetokenizer
from pegainfer.text.tiny_tokenizer import write_tiny_tokenizer
from pegainfer.text.tokenizer import Tokenizer

PIECES = [
    "the", " cat", " sat", " on", " mat", ".", ",", " ", "  ", "\n", "\n\n", "!", "?", " 42", "7",
    "北京", "中国", "首都", "天气", "東京", "ありがとう", "한국", "Straße", " café", " naïve", "Привет",
    "😀", "🎉", "👍🏽", "🚀", "❤️", "👩‍👩‍👧", "🇫🇷", "€", "→", "∞",
    "<|im_end|>", "<think>", "</think>",
]  # fmt: skip
PROMPT = "<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    directory = tmp_path_factory.mktemp("tiny_tokenizer")
    write_tiny_tokenizer(directory)
    return Tokenizer.from_pretrained(directory)


class CountingTokenizer:
    """``tok`` that records the number of ids of every decode call in ``widths``."""

    def __init__(self, tok: Tokenizer, widths: list[int], concatenates: bool = False) -> None:
        self._tok, self._widths = tok, widths
        self.all_special_ids = tok.all_special_ids
        # False: the general path (a window decode per token), whatever ``tok`` allows.
        self.decodes_by_concatenation = concatenates

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self._widths.append(len(ids))
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def decoder(self, skip_special_tokens: bool = True):
        return lambda ids: self.decode(ids, skip_special_tokens)


def _random_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(PIECES) for _ in range(n))


def _chunks(rng: random.Random, ids: Sequence[int]) -> list[list[int]]:
    chunks, i = [], 0
    while i < len(ids):
        size = rng.choice([1, 1, 1, 2, 3])
        chunks.append(list(ids[i : i + size]))
        i += size
    return chunks


def _stream(detok: IncrementalDetokenizer, chunks: list[list[int]]) -> tuple[list[str], str | None]:
    """Feed chunks as an engine would; return every delta (the last one with finished=True) and the stop."""
    deltas, stop = [], None
    for chunk in chunks:
        stop = detok.update(chunk)
        if stop is not None:
            break
        deltas.append(detok.get_delta(finished=False))
    deltas.append(detok.get_delta(finished=True))
    return deltas, stop


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("seed", range(20))
def test_streamed_text_equals_full_decode(tok: Tokenizer, seed: int, skip_special_tokens: bool) -> None:
    rng = random.Random(seed)
    ids = tok.encode(_random_text(rng, rng.randint(1, 40)))
    detok = IncrementalDetokenizer(tok, tok.encode(PROMPT), skip_special_tokens=skip_special_tokens)
    seen = []
    for chunk in _chunks(rng, ids):
        assert detok.update(chunk) is None
        seen.append(detok.get_delta(finished=False))
        assert "\ufffd" not in detok.output_text
    seen.append(detok.get_delta(finished=True))
    expected = tok.decode(ids, skip_special_tokens=skip_special_tokens)
    assert detok.output_text == expected
    assert "".join(seen) == expected
    assert not any("\ufffd" in delta for delta in seen)


def test_multibyte_characters_are_held_until_complete(tok: Tokenizer) -> None:
    ids = tok.encode("👩‍👩‍👧")
    assert len(ids) > 3  # the emoji's bytes are spread over several tokens
    detok = IncrementalDetokenizer(tok, [])
    for token_id in ids:
        detok.update([token_id])
        assert "\ufffd" not in detok.get_delta(finished=False)
    assert detok.output_text + detok.get_delta(finished=True) == "👩‍👩‍👧"


def test_arbitrary_ids_end_equal_to_full_decode(tok: Tokenizer) -> None:
    # Random ids form invalid UTF-8; whatever a full decode shows, the stream must show in the end too.
    rng = random.Random(1)
    for _ in range(30):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 30))]
        detok = IncrementalDetokenizer(tok, [])
        deltas, _ = _stream(detok, _chunks(rng, ids))
        assert detok.output_text == "".join(deltas) == tok.decode(ids)


def test_decode_work_per_token_is_bounded(tok: Tokenizer) -> None:
    widths = []

    ids = tok.encode(_random_text(random.Random(2), 200)) + [tok.pad_token_id] * 100  # e.g. with ignore_eos
    ids += tok.encode(_random_text(random.Random(3), 200))
    detok = IncrementalDetokenizer(CountingTokenizer(tok, widths), tok.encode(PROMPT), stop=["never appears"])
    for token_id in ids:
        detok.update([token_id])
    assert len(ids) > 300 and max(widths) <= 12
    detok.get_delta(finished=True)
    assert detok.output_text == tok.decode(ids)


def test_steady_stream_decodes_once_per_token(tok: Tokenizer) -> None:
    """Once warm, each token costs one decode: the text length of the single token of context is
    remembered across tokens and detokenizers of one tokenizer, and the text is still a full decode."""
    calls: list[int] = []
    counting = CountingTokenizer(tok, calls)
    rng = random.Random(4)  # whole characters only: every token's text is emitted as it arrives
    ids = tok.encode(
        "".join(rng.choice(["the", " cat", " sat", " on", ".", ",", " 42", "!"]) for _ in range(100))
    )
    texts = []
    for _ in range(2):
        detok = IncrementalDetokenizer(counting, [], skip_special_tokens=True)
        calls.clear()
        for token_id in ids:
            detok.update([token_id])
        detok.finish()
        texts.append(detok.output_text)
    assert texts == [tok.decode(ids)] * 2
    # The second pass: one decode per token, plus the empty context's before the first.
    assert len(calls) == len(ids) + 1


def test_invalid_utf8_stream_stays_bounded(tok: Tokenizer) -> None:
    # Byte tokens that never form a character must not make every later step decode a longer window.
    broken = [i for i in range(256) if tok.decode([i]) == "\ufffd"]
    rng = random.Random(3)
    ids = [rng.choice(broken) for _ in range(300)]
    widths = []

    detok = IncrementalDetokenizer(CountingTokenizer(tok, widths), [])
    for token_id in ids:
        detok.update([token_id])
    detok.get_delta(finished=True)
    assert len(broken) > 100 and max(widths) <= 20
    # Stray bytes are flushed as U+FFFD; a character completed right after a flush stays U+FFFD.
    full = tok.decode(ids)
    assert len(detok.output_text) == len(full)
    assert all(a in ("\ufffd", b) for a, b in zip(detok.output_text, full, strict=True))


def test_first_token_keeps_its_leading_space(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, tok.encode("the cat"))
    detok.update(tok.encode(" sat"))
    assert detok.get_delta(finished=True) == " sat"


def _expected_cut(text: str, stops: Sequence[str], include: bool) -> tuple[str, str | None]:
    """Reference: cut the full text at the stop string that is completed first."""
    found = [(i + len(s), i, s) for s in stops if (i := text.find(s)) != -1]
    if not found:
        return text, None
    end, start, stop = min(found)
    return text[: end if include else start], stop


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("seed", range(20))
def test_stop_strings_split_across_tokens(tok: Tokenizer, seed: int, include: bool) -> None:
    rng = random.Random(100 + seed)
    stops = ["STOP here", "😀🎉", "北京", "\n\n"]
    text = _random_text(rng, rng.randint(0, 15)) + rng.choice(stops[:2]) + _random_text(rng, 5)
    ids = tok.encode(text)
    expected, expected_stop = _expected_cut(tok.decode(ids), stops, include)
    detok = IncrementalDetokenizer(tok, [], stop=stops, include_stop_str_in_output=include)
    streamed = ""
    stop = None
    for chunk in _chunks(rng, ids):
        stop = detok.update(chunk)
        if stop is not None:
            break
        streamed += detok.get_delta(finished=False)
        # A stop string is never streamed, not even its beginning before it is complete.
        assert expected.startswith(streamed)
    streamed += detok.get_delta(finished=True)
    assert stop == expected_stop
    assert detok.stop_str == stop
    assert detok.output_text == streamed == expected


def test_partial_stop_string_is_held_back_then_released(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, [], stop=["the end"])
    assert detok.update(tok.encode("the cat, the")) is None
    assert detok.get_delta(finished=False) == "the ca"  # "t, the" could still begin "the end"
    assert detok.update(tok.encode(" mat")) is None
    assert detok.get_delta(finished=False) == "t, t"
    assert detok.get_delta(finished=True) == "he mat"
    assert detok.output_text == "the cat, the mat"


def test_stop_string_at_the_very_start(tok: Tokenizer) -> None:
    for include, expected in [(False, ""), (True, "<think>")]:
        detok = IncrementalDetokenizer(tok, [], stop=["<think>"], include_stop_str_in_output=include)
        assert detok.update(tok.encode("<think>\nhmm")) == "<think>"
        assert detok.get_delta(finished=True) == expected == detok.output_text


def test_stop_in_the_middle_of_one_update(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, [], stop=["sat", "cat sat on"])
    assert detok.update(tok.encode("the cat sat on the mat")) == "sat"
    assert detok.get_delta(finished=True) == detok.output_text == "the cat "
    with pytest.raises(RuntimeError, match="stop string"):
        detok.update(tok.encode("more"))


def test_include_stop_str_streams_without_holding_back(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, [], stop=["mat."], include_stop_str_in_output=True)
    assert detok.update(tok.encode("the cat sat on the ma")) is None
    assert detok.get_delta(finished=False) == "the cat sat on the ma"
    assert detok.update(tok.encode("t. And")) == "mat."
    assert detok.get_delta(finished=True) == "t."
    assert detok.output_text == "the cat sat on the mat."


@pytest.mark.parametrize("seed", range(6))
def test_one_token_steps_equal_update_with_mixed_options(tok: Tokenizer, seed: int) -> None:
    """The engine's step (update_one for every request) gives each detokenizer the text, deltas and stop
    strings its general update would: mixed flags, stop strings, invalid bytes, min_tokens."""
    rng = random.Random(seed)
    streams, pairs = [], []
    for i in range(8):
        ids = tok.encode(_random_text(rng, rng.randint(3, 30)))
        if i % 4 == 3:
            ids += [rng.randrange(tok.vocab_size) for _ in range(10)]  # arbitrary ids: invalid UTF-8 too
        options = {
            "skip_special_tokens": bool(i % 2),
            "stop": [rng.choice(PIECES).strip() or "!"] if i % 3 == 0 else (),
            "include_stop_str_in_output": i % 5 == 0,
        }
        prompt = tok.encode(PROMPT)
        pairs.append(
            (IncrementalDetokenizer(tok, prompt, **options), IncrementalDetokenizer(tok, prompt, **options))
        )
        streams.append(ids)
    for step in range(max(map(len, streams))):
        live = [i for i, ids in enumerate(streams) if step < len(ids) and pairs[i][0].stop_str is None]
        check = [step >= 2 or i % 2 == 0 for i in live]  # some requests still below min_tokens
        for i, c in zip(live, check, strict=True):
            one, single = pairs[i]
            stop = one.update_one(streams[i][step], c)
            assert stop == single.update((streams[i][step],), check_stop=c)
            assert one.get_delta(finished=False) == single.get_delta(finished=False)
    for one, single in pairs:
        assert one.get_delta(finished=True) == single.get_delta(finished=True)
        assert one.output_text == single.output_text and one.stop_str == single.stop_str


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("seed", range(8))
def test_one_token_steps_equal_the_general_update(
    tok: Tokenizer, seed: int, skip_special_tokens: bool
) -> None:
    """update_one (a byte-level tokenizer's tokens that are whole characters are looked up, not decoded)
    gives the deltas and text of update(), over text and over arbitrary ids (special tokens, stray
    bytes of multi-byte characters included)."""
    rng = random.Random(seed)
    ids = tok.encode(_random_text(rng, rng.randint(5, 40)))
    ids += [rng.randrange(tok.vocab_size) for _ in range(rng.randint(0, 30))]
    if seed % 2:
        rng.shuffle(ids)  # stray bytes and special tokens between the words
    assert tok.decodes_by_concatenation
    one = IncrementalDetokenizer(tok, tok.encode(PROMPT), skip_special_tokens=skip_special_tokens)
    general = IncrementalDetokenizer(tok, tok.encode(PROMPT), skip_special_tokens=skip_special_tokens)
    for token in ids:
        assert one.update_one(token) == general.update((token,))
        assert one.get_delta(finished=False) == general.get_delta(finished=False)
    assert one.get_delta(finished=True) == general.get_delta(finished=True)
    assert one.output_text == general.output_text == tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_whole_character_tokens_are_looked_up_not_decoded(tok: Tokenizer) -> None:
    """With a byte-level tokenizer a steady stream of whole-character tokens decodes each distinct token
    once (its text is cached for every detokenizer), never a window."""
    widths: list[int] = []
    ids = tok.encode(" the cat sat on the mat. the cat sat on the mat.")
    detok = IncrementalDetokenizer(CountingTokenizer(tok, widths, concatenates=True), [])
    detok.update_one(ids[0])
    widths.clear()
    for token in ids[1:]:
        detok.update_one(token)
    assert set(widths) <= {1} and len(widths) <= len(set(ids[1:]))
    assert detok.output_text == tok.decode(ids)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("seed", range(12))
def test_byte_level_steps_equal_window_decodes(tok: Tokenizer, seed: int, skip_special_tokens: bool) -> None:
    """A byte-level tokenizer's update_one takes a token's text as its own after whole characters and at
    a whole-character token (no window decode): over streams dense in stray and partial bytes, special
    tokens and stop strings, it gives the deltas, stops and text of the window decodes of the general
    path (a tokenizer that does not claim to concatenate)."""
    rng = random.Random(200 + seed)
    broken = [i for i in range(256) if "\ufffd" in tok.decode([i])]
    ids = []
    while len(ids) < 120:
        pick = rng.random()
        if pick < 0.4:  # runs long enough to be flushed as invalid, or to complete a character
            ids.extend(rng.choice(broken) for _ in range(rng.randint(1, 12)))
        elif pick < 0.8:
            ids.extend(tok.encode(_random_text(rng, 1)))
        else:
            ids.append(rng.randrange(tok.vocab_size))
    options = {
        "skip_special_tokens": skip_special_tokens,
        "stop": ["€", "never"] if seed % 3 == 0 else (),
        "include_stop_str_in_output": seed % 2 == 0,
    }
    prompt = tok.encode(PROMPT)
    fast = IncrementalDetokenizer(tok, prompt, **options)
    windows = IncrementalDetokenizer(CountingTokenizer(tok, []), prompt, **options)
    for token in ids:
        stop = fast.update_one(token)
        assert stop == windows.update_one(token)
        assert fast.get_delta(finished=False) == windows.get_delta(finished=False)
        if stop is not None:
            break
    assert fast.get_delta(finished=True) == windows.get_delta(finished=True)
    assert fast.output_text == windows.output_text


def test_whole_character_token_after_stray_bytes_is_looked_up(tok: Tokenizer) -> None:
    """After held or flushed partial characters, a token that is whole characters on its own needs no
    decode of the window before it: its text is looked up (the window restarts at it)."""
    widths: list[int] = []
    counting = CountingTokenizer(tok, widths, concatenates=True)
    broken = [i for i in range(256) if tok.decode([i]) == "\ufffd"]
    words = tok.encode(" the cat sat")
    IncrementalDetokenizer(counting, []).update([*words, *broken[:3]])  # every single-token text cached
    detok = IncrementalDetokenizer(counting, [])
    for token in [*words, broken[0], *words, broken[1], broken[2], *words]:
        detok.update_one(token)
    widths.clear()
    detok.update_one(broken[0])  # held after a whole-character token: looked up
    detok.update_one(words[0])  # closes the held byte: one decode of the two new tokens
    detok.update_one(words[1])  # whole characters after an invalid byte: looked up
    assert widths == [2]
    detok.finish()
    expected = [*words, broken[0], *words, broken[1], broken[2], *words, broken[0], *words[:2]]
    assert detok.output_text == tok.decode(expected)


def test_skipped_special_token_stays_dropped_after_a_keeping_detokenizer(tok: Tokenizer) -> None:
    """The shared cache of whole-character texts is kept per skip_special_tokens: a special token that one
    detokenizer keeps (and so caches) is still dropped by one that skips special tokens."""
    special = next(iter(tok.all_special_ids))
    word = tok.encode(" cat")[0]
    keeping = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    skipping = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    for detok in (keeping, skipping, keeping, skipping):
        detok.update_one(word)
        detok.update_one(special)
    assert keeping.output_text == tok.decode([word, special] * 2, skip_special_tokens=False)
    assert skipping.output_text == tok.decode([word, special] * 2, skip_special_tokens=True) == " cat cat"
