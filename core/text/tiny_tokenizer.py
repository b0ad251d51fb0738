"""A real, tiny byte-level BPE tokenizer for the demo models and tests: trained in well under a second,
byte-for-byte stable."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers.trainers import BpeTrainer

# Qwen-style split: English contractions, letter runs with one leading non-letter, single digits,
# punctuation runs, newlines, and whitespace that leaves one space to lead the next word.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

TRAINED_VOCAB_SIZE = 995
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Reasoning markers are added but not special, so decoding with skip_special_tokens keeps them (as Qwen3 does).
THINK_TOKENS = ("<think>", "</think>")

CORPUS = """\
The little lighthouse stood at the end of the harbour wall. Every evening the keeper climbed the
ninety-two steps, wound the clockwork, and watched the lamp turn over the grey water. Ships that
passed in the night never saw him; they only saw the light, and that was enough for them.

When it rains in the mountains, the river rises quickly. The farmers move their sheep to higher
ground, and the children are told to stay away from the old stone bridge. "It has stood for three
hundred years," said the miller, "but I wouldn't trust it tonight." Nobody argued with him.

To make bread you need flour, water, salt and patience. Mix 500 g of flour with 350 ml of warm
water, add 10 g of salt and 7 g of yeast, then knead for ten minutes. Let it rise for 1-2 hours!
Bake at 230 degrees until the crust is brown & the loaf sounds hollow when you tap it.

A computer program is a list of instructions. def add(a, b): return a + b  # adds two numbers
for i in range(10): print(i * i) ... if x >= 0 and y != 1: z = {"key": [1, 2, 3]}
Errors happen; tests catch them. Don't panic, read the message, and fix one thing at a time.

Questions? Answers! What's the time? It's 12:45. Where are you going? We're going home, they've
gone already, and I'll follow soon. The assistant replied: "Sure, here is a short summary."

北京是中国的首都。今天天气很好，我们去公园散步吧。学习语言需要时间和耐心。
東京は日本の首都です。ありがとうございます。今日はいい天気ですね。
서울은 한국의 수도입니다. 감사합니다.
Le café est très bon à Paris; où est la gare? Ça coûte cinq euros, s'il vous plaît.
Die Straße ist schön, und die Bäume blühen. Übung macht den Meister.
¿Dónde está la biblioteca? El niño come una manzana. Москва — столица России. Привет, мир!
Emoji: 😀 🎉 👍🏽 🚀 ❤️ 🌍 — and symbols like € £ ¥ © ™ ± × ÷ → ∞.
"""

CHAT_TEMPLATE = """\
{%- if tools %}
<|im_start|>system
{% if messages and messages[0].role == 'system' %}
{{ messages[0].content }}

{% endif %}
You can call these tools:
{% for tool in tools %}
{{ tool | tojson }}
{% endfor %}
<|im_end|>
{% endif %}
{% for message in messages %}
{% if message.role == 'system' %}
{% if not tools %}
<|im_start|>system
{{ message.content }}<|im_end|>
{% endif %}
{% elif message.role in ['user', 'assistant'] %}
<|im_start|>{{ message.role }}
{% if message.reasoning_content %}
<think>
{{ message.reasoning_content }}
</think>

{% endif %}
{{ message.content or '' }}
{%- for call in message.tool_calls or [] %}

<tool_call>
{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}
</tool_call>
{%- endfor %}
<|im_end|>
{% elif message.role == 'tool' %}
<|im_start|>tool
{{ message.content }}<|im_end|>
{% else %}
{{ raise_exception('unknown message role: ' ~ message.role) }}
{% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
"""


def build_tiny_tokenizer() -> Tokenizer:
    """Train the tiny tokenizer in memory; the same object (and serialization) on every call."""
    tokenizer = Tokenizer(models.BPE(fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = BpeTrainer(
        vocab_size=TRAINED_VOCAB_SIZE,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS.split("\n\n"), trainer=trainer)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    return tokenizer


def _added_tokens_decoder(tokenizer: Tokenizer) -> dict[str, dict]:
    # transformers rebuilds Qwen2Tokenizer from vocab + merges, so the added tokens must be listed here too.
    return {
        str(token_id): {
            "content": token.content,
            "lstrip": token.lstrip,
            "rstrip": token.rstrip,
            "normalized": token.normalized,
            "single_word": token.single_word,
            "special": token.special,
        }
        for token_id, token in sorted(tokenizer.get_added_tokens_decoder().items())
    }


def write_tiny_tokenizer(directory: Path) -> int:
    """Write tokenizer.json and tokenizer_config.json into `directory`; return the total vocab size."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer()
    (directory / "tokenizer.json").write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": _added_tokens_decoder(tokenizer),
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }
    text = json.dumps(config, indent=2, ensure_ascii=False, sort_keys=True) + "\n"
    (directory / "tokenizer_config.json").write_text(text, encoding="utf-8")
    return tokenizer.get_vocab_size(with_added_tokens=True)
