"""Structured outputs: a grammar every sampled token must keep the answer inside (a JSON schema, a regular
expression, a choice of strings, or a Lark grammar), enforced with llguidance's matcher.

Contract: the engine gives each request with ``SamplingParams.structured_outputs`` its own matcher
(:meth:`GrammarCompiler.matcher`, at ``add_request``: a bad grammar is a ``RequestError`` then, naming
``structured_outputs``); the sampler masks each such row's logits with :func:`allowed_tokens` before
penalties and draws; the output processor feeds every appended token to the matcher and finishes the
request once the grammar is complete. With ``after`` the matcher waits (``Request.deferred_grammar``)
until that token is appended: reasoning first, then the structured answer. Because the mask is computed
from the tokens appended so far, the round-by-round verification of speculative drafts and async
scheduling (which samples a step after the last step's tokens were appended) need nothing more.

llguidance is imported on first use only: an engine that never sees a grammar does not load it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

from pegainfer.errors import RequestError
from pegainfer.text.tokenizer import Tokenizer

PARAM = "structured_outputs"
#: llguidance raises ValueError or RuntimeError for what it cannot take, or a Rust panic, whose exception
#: derives from BaseException only: every BaseException but these is such a failure.
_NOT_FAILURES = (KeyboardInterrupt, SystemExit, GeneratorExit)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of: ``json`` (a JSON schema, as a dict or its text), ``regex``, ``choice`` (the answer
    is one of these strings), ``grammar`` (Lark syntax in llguidance's dialect, or llama.cpp's GBNF).
    vLLM's names."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    #: The request field errors name (the server's: ``response_format``, ``tool_choice``...).
    param: str = PARAM
    #: A text of one token (a reasoning model's ``</think>``): the grammar applies from the token after it,
    #: the answer free until it is generated (None: from the first token).
    after: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if len(given) != 1:
            raise RequestError(f"structured outputs take exactly one of json, regex, choice, grammar; got {given}",
                               param=self.param)  # fmt: skip
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise RequestError("choice must be a non-empty list of strings", param=self.param)

    def llguidance_grammar(self) -> str:
        from llguidance import LLMatcher, grammar_from

        if self.json is not None:
            schema = json.loads(self.json) if isinstance(self.json, str) else self.json
            if isinstance(schema, dict):
                # One separator style (", " and ": "), no free whitespace: a model cannot stall the answer
                # in endless blanks; a schema's own "x-guidance" options win.
                schema = {
                    **schema,
                    "x-guidance": {"whitespace_flexible": False, **schema.get("x-guidance", {})},
                }
            return LLMatcher.grammar_from_json_schema(json.dumps(schema))
        if self.regex is not None:
            return grammar_from("regex", self.regex)
        if self.choice is not None:
            return grammar_from("choice", self.choice)
        return grammar_from("grammar", self.grammar)  # Lark, or GBNF converted to it


class GrammarCompiler:
    """An engine's grammars: its tokenizer in llguidance's form (built once, on the first grammar: about a
    second for a real vocabulary), over ``vocab_size`` logits columns (the model's, which may be padded
    past the tokenizer's ids: those columns are never allowed)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._lltokenizer: Any = None
        self._unavailable: str | None = None  # why llguidance cannot take this tokenizer, once known

    def matcher(self, params: StructuredOutputsParams) -> Any:
        """A fresh matcher at the start of the answer; ``RequestError`` for a grammar that does not compile
        (or a tokenizer llguidance cannot read: said once, then every structured request is refused)."""
        import llguidance

        if self._lltokenizer is None and self._unavailable is None:
            try:
                self._lltokenizer = llguidance.LLTokenizer(
                    self._tokenizer.backend_json(),
                    n_vocab=self._vocab_size,
                    eos_token=list(self._tokenizer.eos_token_ids) or None,
                )
            except BaseException as exc:
                if isinstance(exc, _NOT_FAILURES):
                    raise
                self._unavailable = f"structured outputs are unavailable for this model's tokenizer: {exc}"
        if self._unavailable is not None:
            raise RequestError(self._unavailable, param=params.param)
        try:
            matcher = llguidance.LLMatcher(self._lltokenizer, params.llguidance_grammar())
        except BaseException as exc:
            if isinstance(exc, _NOT_FAILURES):
                raise
            raise RequestError(f"the structured output does not compile: {exc}", param=params.param) from None
        if matcher.is_error():
            raise RequestError(
                f"the structured output does not compile: {matcher.get_error()}", param=params.param
            )
        return matcher

    def after_token(self, params: StructuredOutputsParams) -> int | None:
        """The token id of ``params.after``; ``RequestError`` unless it is one token of the vocabulary."""
        if params.after is None:
            return None
        ids = self._tokenizer.encode(params.after, add_special_tokens=False)
        if len(ids) != 1:
            raise RequestError(
                f"the structured output starts after {params.after!r}, which is not one token here",
                param=params.param,
            )
        return ids[0]


def allowed_tokens(matchers: list[Any], vocab: int, device: torch.device) -> torch.Tensor:
    """``[len(matchers), vocab]`` bool: the tokens each matcher accepts next (its bitmask, unpacked)."""
    masks = b"".join(matcher.compute_bitmask() for matcher in matchers)  # 32 tokens a little-endian word
    words = torch.frombuffer(bytearray(masks), dtype=torch.int32).view(len(matchers), -1).to(device)
    bits = torch.arange(32, dtype=torch.int32, device=device)
    allowed = ((words[:, :, None] >> bits) & 1).bool().flatten(1)
    if allowed.shape[1] < vocab:  # logits columns past the grammar's vocabulary: never allowed
        allowed = torch.cat([allowed, allowed.new_zeros(len(matchers), vocab - allowed.shape[1])], dim=1)
    return allowed[:, :vocab]


def consume(matcher: Any, token: int) -> bool:
    """Feed the matcher ``token``; whether its grammar is complete now (the answer must end here)."""
    if not matcher.consume_token(token):
        # The sampler only draws allowed tokens: this is a bug, not bad input.
        raise RuntimeError(f"token {token} is outside the structured output: {matcher.get_error()}")
    return matcher.is_stopped()
