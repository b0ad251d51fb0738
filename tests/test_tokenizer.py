"""pegainfer.text.tokenizer against transformers' AutoTokenizer on the tiny tokenizer checkpoint."""

from __future__ import annotations

import datetime
import json
import random
import shutil
from pathlib import Path

import pytest

from pegainfer.errors import CheckpointError, RequestError
from pegainfer.text.tiny_tokenizer import write_tiny_tokenizer
from pegainfer.text.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "don't, won't, we'll, they've, I'M HERE",
    "  leading and trailing spaces   ",
    "tabs\tand\t\tmore\ttabs\n\nnew\r\nlines\n   \n",
    "numbers 1234567890 and 3.14159, 1e-9, -42",
    "punctuation!?.,;:'\"()[]{}<>/\\|@#$%^&*_+=~`",
    "北京是中国的首都。東京は日本の首都です。서울은 한국의 수도입니다.",
    "emoji 😀🎉👍🏽🚀 ❤️ 👩‍👩‍👧 flags 🇫🇷",
    "café naïve Straße coöperate e\u0301 (combining accent)",
    "Москва — столица России. ¿Dónde está?",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text <|im_end|>",
    "<think>\nreasoning here\n</think>\n\nanswer",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3 + 3? Answer in 中文 😀"},
    ],
    [
        {"role": "user", "content": "Think first."},
        {"role": "assistant", "content": "Done.", "reasoning_content": "Let me think..."},
        {"role": "user", "content": "Again"},
    ],
    [
        {"role": "system", "content": "Use tools when useful."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}
            ],
        },
        {"role": "tool", "content": "18°C, sunny"},
    ],
]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "Current weather in a city (e.g. 北京)",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny_tokenizer")
    write_tiny_tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def tok(tiny_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_dir)


@pytest.fixture(scope="module")
def hf(tiny_dir: Path):
    return transformers.AutoTokenizer.from_pretrained(str(tiny_dir))


def _copy_without(tiny_dir: Path, tmp_path: Path, **config_changes: object) -> Path:
    """A copy of the tiny checkpoint with tokenizer_config.json keys replaced (None removes a key)."""
    target = tmp_path / "ckpt"
    shutil.copytree(tiny_dir, target)
    config = json.loads((target / "tokenizer_config.json").read_text())
    for key, value in config_changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    return target


def test_write_tiny_tokenizer_is_deterministic(tmp_path: Path) -> None:
    sizes = [write_tiny_tokenizer(tmp_path / name) for name in ("a", "b")]
    assert sizes[0] == sizes[1] == 1000
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_vocabulary_and_special_ids(tok: Tokenizer, hf) -> None:
    assert tok.vocab_size == len(hf) == 1000
    assert tok.eos_token_id == hf.eos_token_id == hf.convert_tokens_to_ids("<|im_end|>")
    assert tok.pad_token_id == hf.pad_token_id == hf.convert_tokens_to_ids("<|endoftext|>")
    assert tok.bos_token_id is None and hf.bos_token_id is None
    assert tok.all_special_ids >= set(hf.all_special_ids)
    assert hf.convert_tokens_to_ids("<|im_start|>") in tok.all_special_ids
    assert hf.convert_tokens_to_ids("<think>") not in tok.all_special_ids
    assert tok.eos_token_ids == (tok.eos_token_id,)


def test_add_eos_token_ids_keeps_order_and_drops_duplicates(tiny_dir: Path) -> None:
    tok = Tokenizer.from_pretrained(tiny_dir)
    tok.add_eos_token_ids([995, tok.eos_token_id, 996, 995])
    assert tok.eos_token_ids == (tok.eos_token_id, 995, 996)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(tok: Tokenizer, hf, text: str) -> None:
    ids = tok.encode(text)
    assert ids == hf(text)["input_ids"]
    assert tok.encode(text, add_special_tokens=False) == hf(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)


def test_decode_of_arbitrary_ids_matches_transformers(tok: Tokenizer, hf) -> None:
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 20))]
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
        assert tok.decode(ids, skip_special_tokens=False) == hf.decode(ids)


def test_id_to_token(tok: Tokenizer, hf) -> None:
    assert tok.id_to_token(tok.eos_token_id) == "<|im_end|>"
    assert tok.id_to_token(10) == hf.convert_ids_to_tokens(10)
    with pytest.raises(RequestError, match="outside the vocabulary"):
        tok.id_to_token(tok.vocab_size)


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    tok: Tokenizer, hf, messages, add_generation_prompt: bool
) -> None:
    ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == theirs
    assert ours.endswith("<|im_start|>assistant\n") == add_generation_prompt
    assert (
        tok.encode_chat(messages, add_generation_prompt=add_generation_prompt)
        == hf(theirs, add_special_tokens=False)["input_ids"]
    )


@pytest.mark.parametrize("messages", CONVERSATIONS[1:])
def test_chat_template_with_tools_matches_transformers(tok: Tokenizer, hf, messages) -> None:
    ours = tok.apply_chat_template(messages, tools=TOOLS)
    assert ours == hf.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert "北京" in ours  # tojson keeps non-ASCII text


def test_custom_template_filters_and_variables_match_transformers(tok: Tokenizer, hf) -> None:
    template = (
        "{{ bos_token is defined }}|{{ eos_token }}|{{ pad_token }}|{{ flavour }}\n"
        "{{ messages | tojson(indent=2) }}\n"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content | upper }}{% endfor %}\n"
        "{% generation %}kept{% endgeneration %}"
    )
    messages = CONVERSATIONS[1]
    ours = tok.apply_chat_template(messages, chat_template=template, flavour="vanilla")
    theirs = hf.apply_chat_template(messages, chat_template=template, tokenize=False, flavour="vanilla")
    assert ours == theirs
    assert ours.startswith("False|<|im_end|>|<|endoftext|>|vanilla\n[\n  {")


def test_strftime_now_is_available(tok: Tokenizer) -> None:
    rendered = tok.apply_chat_template(
        [], chat_template="{{ strftime_now('%Y') }}", add_generation_prompt=False
    )
    assert rendered == str(datetime.date.today().year)


def test_raise_exception_becomes_request_error(tok: Tokenizer) -> None:
    with pytest.raises(RequestError, match="unknown message role: narrator"):
        tok.apply_chat_template([{"role": "narrator", "content": "Once upon a time"}])


def test_template_errors_are_request_errors(tok: Tokenizer) -> None:
    with pytest.raises(RequestError, match="syntax error"):
        tok.apply_chat_template([], chat_template="{% if %}")
    with pytest.raises(RequestError, match="failed to render"):
        tok.apply_chat_template([{"content": 1}], chat_template="{{ messages[0].content + 'x' }}")


def test_missing_chat_template_is_a_request_error(tiny_dir: Path, tmp_path: Path) -> None:
    tok = Tokenizer.from_pretrained(_copy_without(tiny_dir, tmp_path, chat_template=None))
    with pytest.raises(RequestError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tok.encode("hi") == Tokenizer.from_pretrained(tiny_dir).encode("hi")


def test_chat_template_file_and_named_templates(tiny_dir: Path, tmp_path: Path, hf) -> None:
    named = [
        {"name": "default", "template": "D{{ messages | length }}"},
        {"name": "tool_use", "template": "T"},
    ]
    folder = _copy_without(tiny_dir, tmp_path, chat_template=named)
    tok = Tokenizer.from_pretrained(folder)
    messages = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages) == "D1"
    assert tok.apply_chat_template(messages, tools=TOOLS) == "T"
    assert tok.apply_chat_template(messages, chat_template="tool_use") == "T"

    (folder / "chat_template.jinja").write_text("file: {{ messages[0].content }}")
    tok = Tokenizer.from_pretrained(folder)
    theirs = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert tok.apply_chat_template(messages) == "file: hi"
    assert theirs.apply_chat_template(messages, tokenize=False) == "file: hi"


def test_added_token_dicts_in_config(tiny_dir: Path, tmp_path: Path) -> None:
    eos = {"content": "<|endoftext|>", "special": True, "lstrip": False, "rstrip": False}
    tok = Tokenizer.from_pretrained(_copy_without(tiny_dir, tmp_path, eos_token=eos))
    assert tok.eos_token_id == tok.encode("<|endoftext|>")[0]
    assert tok.apply_chat_template([], chat_template="{{ eos_token }}") == "<|endoftext|>"


def test_checkpoint_errors_name_the_file(tiny_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)
    folder = _copy_without(tiny_dir, tmp_path)
    (folder / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="tokenizer_config.json"):
        Tokenizer.from_pretrained(folder)
    (folder / "tokenizer.json").write_text("{}")
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        Tokenizer.from_pretrained(folder)


def test_unknown_special_token_is_a_checkpoint_error(tiny_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="<nope>"):
        Tokenizer.from_pretrained(_copy_without(tiny_dir, tmp_path, eos_token="<nope>"))
