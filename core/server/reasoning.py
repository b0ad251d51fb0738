"""A thinking model's reasoning apart from its answer (``server.reasoning_parser``): the text of a
``<think>…</think>`` block is returned as the message's ``reasoning_content`` (and ``reasoning``, vLLM's
newer name), the text after it as ``content``.

Where the block starts decides the split. Qwen3's first templates let the model write ``<think>`` itself;
Qwen3.5's, DeepSeek-R1's and V3.1's thinking mode end the prompt inside an open block, so the answer
starts as reasoning and only ``</think>`` appears in it; with thinking switched off
(``enable_thinking: false``, ``thinking: false``) the prompt closes the block and the answer is all
content. So: the answer starts inside the block when the rendered prompt ends by opening one (or, with
``continue_final_message``, the continued message left one open), or when the answer itself opens with
``<think>``; an answer that never closes its block (cut by ``max_tokens``) is all reasoning. A ``<think>``
elsewhere in the prompt (a system message asking for the tags, a tool's HTML) opens nothing. A grammar
(structured outputs, a forced tool choice) then starts after the block (``ChatServing._thinking``).
"""

from __future__ import annotations

from typing import Literal

from pegainfer.server.streaming import partial_marker

THINK_START, THINK_END = "<think>", "</think>"

# vLLM's parser names for these families, all the same tags: one parser serves each.
ParserName = Literal["think", "qwen3", "deepseek_r1", "deepseek_v3"]


def opens_thinking(prompt: str, continued: str | None = None) -> bool:
    """Whether the answer starts as reasoning: the rendered prompt ends with ``<think>`` (the template's
    generation prompt opened the block), or ``continued`` (the final message's text, which the answer
    continues) leaves a block open."""
    if continued is not None:
        start = continued.rfind(THINK_START)
        return start >= 0 and continued.rfind(THINK_END) < start
    return prompt.rstrip().endswith(THINK_START)


def split_reasoning(text: str, thinking: bool) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole answer; None for a part that is absent or empty. An opening tag at
    the very start is dropped even where the prompt opened the block already (a model that repeats it)."""
    if text.startswith(THINK_START):
        text, thinking = text[len(THINK_START) :], True
    if not thinking:
        return None, text
    end = text.find(THINK_END)
    if end < 0:
        return text or None, None
    return text[:end] or None, text[end + len(THINK_END) :] or None


class ReasoningStream:
    """``split_reasoning`` over streamed pieces: ``feed`` returns the (reasoning, content) text each piece
    adds, holding back what may be the start of a tag until the next piece says; ``finish`` the rest."""

    def __init__(self, thinking: bool) -> None:
        self._thinking = thinking
        self._state = "start"
        self._held = ""

    def feed(self, piece: str) -> tuple[str, str]:
        text, self._held = self._held + piece, ""
        reasoning = ""
        if self._state == "start":
            if text.startswith(THINK_START):
                self._state, text = "reasoning", text[len(THINK_START) :]
            elif THINK_START.startswith(text):
                self._held = text  # "<thi": maybe the block's opening
                return "", ""
            else:
                self._state = "reasoning" if self._thinking else "content"
        if self._state == "reasoning":
            end = text.find(THINK_END)
            if end < 0:
                keep = partial_marker(text, (THINK_END,))
                self._held = text[len(text) - keep :]
                return text[: len(text) - keep], ""
            reasoning, text = text[:end], text[end + len(THINK_END) :]
            self._state = "content"
        return reasoning, text

    @property
    def in_content(self) -> bool:
        """Whether the block has closed (or never opened): what follows is content."""
        return self._state == "content"

    def finish(self) -> tuple[str, str]:
        """What is held at the end: the text of a tag that never completed."""
        held, self._held = self._held, ""
        inside = self._state == "reasoning" or (self._state == "start" and self._thinking)
        return (held, "") if inside else ("", held)
