"""Text: tokenizers and chat templates (``tokenizer``), incremental detokenization (``detokenizer``)
and the tiny byte-level tokenizer of the demos (``tiny_tokenizer``).
"""
