"""Text <-> token ids and chat-template rendering for a checkpoint folder, matching transformers' output."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pegainfer.errors import CheckpointError, RequestError

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


class Tokenizer:
    """A `tokenizers` backend plus the special tokens and chat templates from the tokenizer config."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        special_tokens: Mapping[str, str] | None = None,
        chat_templates: Mapping[str, str] | None = None,
    ) -> None:
        self._backend = backend
        self._special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self._chat_templates = dict(chat_templates or {})
        self._special_ids = {key: self._require_id(token) for key, token in self._special_tokens.items()}
        eos = self._special_ids.get("eos_token")
        self._eos_token_ids: tuple[int, ...] = () if eos is None else (eos,)
        self._all_special_ids = frozenset(
            i for i, tok in backend.get_added_tokens_decoder().items() if tok.special
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json and chat_template.jinja (when present) from a folder."""
        folder = Path(path)
        tokenizer_file = folder / TOKENIZER_FILE
        if not tokenizer_file.is_file():
            raise CheckpointError(
                f"{tokenizer_file} is missing: pegainfer needs a fast-tokenizer tokenizer.json"
            )
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the Rust side raises a bare Exception for every parse failure
            raise CheckpointError(f"{tokenizer_file} could not be parsed: {exc}") from exc
        config = _read_config(folder / TOKENIZER_CONFIG_FILE)
        special_tokens = {key: _token_content(config.get(key), key, folder) for key in _SPECIAL_TOKEN_KEYS}
        return cls(
            backend, special_tokens=special_tokens, chat_templates=_read_chat_templates(folder, config)
        )

    def backend_json(self) -> str:
        """The tokenizer.json text of the backend (what grammar libraries build their vocabulary from)."""
        return self._backend.to_str()

    # --- encoding -----------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, identical to transformers' `tokenizer(text)["input_ids"]`."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`, identical to transformers' `tokenizer.decode(ids, skip_special_tokens=...)`."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @functools.cached_property
    def decodes_by_concatenation(self) -> bool:
        """Whether the decoder is byte-level only: a sequence's text is then the UTF-8 decode of its tokens'
        bytes one after the other, so tokens that are whole characters decode alone as in any sequence."""
        return isinstance(self._backend.decoder, tokenizers.decoders.ByteLevel)

    def decoder(self, skip_special_tokens: bool = True) -> Callable[[list[int]], str]:
        """``decode`` for lists of ids, as one call straight into the tokenizer library (for callers that
        decode on every generated token)."""
        return functools.partial(self._backend.decode, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary string of one id; RequestError when the id is outside the vocabulary."""
        token = self._backend.id_to_token(token_id)
        if token is None:
            raise RequestError(f"token id {token_id} is outside the vocabulary (size {self.vocab_size})")
        return token

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        """The vocabulary strings of `ids`, in order."""
        return [self.id_to_token(i) for i in ids]

    # --- vocabulary and special tokens --------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._special_ids.get("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        """The config's eos token; generation may also stop on the others in `eos_token_ids`."""
        return self._special_ids.get("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_ids.get("pad_token")

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation: the config's eos token, then any added later."""
        return self._eos_token_ids

    def add_eos_token_ids(self, ids: Iterable[int]) -> None:
        """Also end generation on `ids` (e.g. generation_config.json's eos_token_id); duplicates are ignored."""
        self._eos_token_ids = tuple(dict.fromkeys((*self._eos_token_ids, *ids)))

    @property
    def all_special_ids(self) -> frozenset[int]:
        """Ids of the added tokens flagged special in tokenizer.json: exactly what decode can skip."""
        return self._all_special_ids

    def _require_id(self, token: str) -> int:
        token_id = self._backend.token_to_id(token)
        if token_id is None:
            raise CheckpointError(
                f"{TOKENIZER_CONFIG_FILE} names special token {token!r}, not in {TOKENIZER_FILE}"
            )
        return token_id

    # --- chat templates -----------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render `messages` as transformers' `apply_chat_template(..., tokenize=False)` does.

        `chat_template` is either the name of one of the checkpoint's templates or a template's source.
        Extra keyword arguments become template variables (e.g. `enable_thinking=False`).
        """
        source, user_supplied = self._select_template(chat_template, tools)
        template = _compile(source, user_supplied)
        variables: dict[str, Any] = {**self._special_tokens, **template_kwargs}
        try:
            return template.render(
                messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **variables
            )
        except (jinja2.TemplateError, TypeError) as exc:
            raise RequestError(
                f"chat template failed to render the messages: {exc}", param="messages"
            ) from exc

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> list[int]:
        """Token ids of the rendered conversation; the template supplies the special tokens itself."""
        text = self.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            chat_template=chat_template,
            **template_kwargs,
        )
        return self.encode(text, add_special_tokens=False)

    def chat_template_source(
        self, chat_template: str | None = None, tools: Sequence[Mapping[str, Any]] | None = None
    ) -> str:
        """The source of the template :meth:`apply_chat_template` renders with these arguments."""
        return self._select_template(chat_template, tools)[0]

    def _select_template(self, chat_template: str | None, tools: object) -> tuple[str, bool]:
        if chat_template is not None:
            if chat_template in self._chat_templates:
                return self._chat_templates[chat_template], False
            return chat_template, True
        if tools and "tool_use" in self._chat_templates:
            return self._chat_templates["tool_use"], False
        if "default" in self._chat_templates:
            return self._chat_templates["default"], False
        if not self._chat_templates:
            raise RequestError(
                "the checkpoint has no chat template; send a plain prompt or pass chat_template"
            )
        raise RequestError(
            f"the checkpoint has several chat templates and no default; choose one of {sorted(self._chat_templates)}"
        )


# --- loading helpers ----------------------------------------------------------------------------------


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return config


def _token_content(value: object, key: str, folder: Path) -> str | None:
    # Values are plain strings or serialized AddedToken dicts, depending on the transformers version.
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise CheckpointError(
        f"{folder / TOKENIZER_CONFIG_FILE}: {key} must be a string or have a 'content' string"
    )


def _read_chat_templates(folder: Path, config: Mapping[str, Any]) -> dict[str, str]:
    config_path = folder / TOKENIZER_CONFIG_FILE
    raw = config.get("chat_template")
    templates: dict[str, str] = {}
    if isinstance(raw, str):
        templates["default"] = raw
    elif isinstance(raw, list):
        for entry in raw:
            if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)):
                raise CheckpointError(f"{config_path}: chat_template entries need a 'name' and a 'template'")
            templates[entry["name"]] = entry.get("template")
    elif raw is not None:
        raise CheckpointError(f"{config_path}: chat_template must be a string or a list of named templates")
    # Separate files are the newer layout and take priority over the config's entries, as in transformers.
    files = {"default": folder / CHAT_TEMPLATE_FILE}
    template_dir = folder / CHAT_TEMPLATE_DIR
    if template_dir.is_dir():
        files.update({p.stem: p for p in sorted(template_dir.glob("*.jinja"))})
    for name, path in files.items():
        if path.is_file():
            templates[name] = path.read_text(encoding="utf-8")
    for name, source in templates.items():
        if not isinstance(source, str):
            raise CheckpointError(f"{config_path}: chat template {name!r} is not a string")
    return templates


# --- jinja ----------------------------------------------------------------------------------------------


def _raise_exception(message: str) -> None:
    raise RequestError(message, param="messages")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    indent: int | None = None,
    ensure_ascii: bool = False,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's built-in tojson escapes HTML characters and non-ASCII text, which would change the prompt.
    return json.dumps(
        value, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys
    )


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering ignores it."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


@functools.cache
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", _GenerationTag]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=64)
def _compile(source: str, user_supplied: bool) -> jinja2.Template:
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        if user_supplied:
            raise RequestError(f"chat_template has a syntax error: {exc}", param="chat_template") from exc
        raise CheckpointError(f"the checkpoint's chat template has a syntax error: {exc}") from exc
