"""Loading a model's tokenizer without the Python copy of its vocabulary.

transformers 5 builds BPE tokenizers of some families (Gemma, GPT-2, GPT-NeoX) from `_vocab` (a dict of
every token) and `_merges` (a list of pairs) parsed from tokenizer.json, and keeps both on the tokenizer
after handing them to the Rust tokenizer, which encodes and decodes from its own copy. At Gemma 3's
262k vocabulary the two hold 125 MiB of Python objects (143 MiB of RSS) for as long as the tokenizer
lives, in every stage; `load_tokenizer` lets them go. Tokenizers without them are returned as loaded.
"""

from __future__ import annotations

from pathlib import Path

PYTHON_COPIES = ("_vocab", "_merges")  # what transformers' BPE tokenizers keep from their construction


def load_tokenizer(path: str | Path, *, trust_remote_code: bool = False, **kwargs):
    """AutoTokenizer.from_pretrained(path, ...) without the construction-time copies above; errors
    are transformers' (callers name the model)."""
    from transformers import AutoTokenizer

    return release_python_vocab(AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, **kwargs))


def release_python_vocab(tokenizer):
    """Drop a Rust-backed tokenizer's Python vocabulary/merges copies (encoding, decoding and saving go
    through its `backend_tokenizer`); anything else is left alone."""
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        return tokenizer
    for name in PYTHON_COPIES:
        if isinstance(getattr(tokenizer, name, None), (dict, list)):
            setattr(tokenizer, name, None)
    return tokenizer
