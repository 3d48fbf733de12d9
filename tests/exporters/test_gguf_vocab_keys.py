"""GGUF tokenizer keys that need no llama.cpp to check: the space prefix written as the tokenizer
does it, and the conversion cache naming the GGUF whose tokenizer the exporter reuses."""

from __future__ import annotations

import json

import pytest

from exporters import gguf_vocab
from laco_deploy.artifacts import SOURCE_FILE, record_gguf_source


@pytest.mark.parametrize("tok_json, prefix", [
    (None, None),  # no tokenizer.json: llama.cpp's default stands
    ({"normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}}, False),  # Gemma
    ({"normalizer": {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "\u2581"}]}}, True),  # Llama 2
    ({"pre_tokenizer": {"type": "Metaspace", "prepend_scheme": "first"}}, True),
    ({"pre_tokenizer": {"type": "Metaspace", "prepend_scheme": "never"}}, False),
])
def test_space_prefix_is_written_as_the_tokenizer_does_it(tok_json, prefix):
    """llama.cpp prepends a space to this vocabulary unless told not to: a tokenizer that prepends
    nothing (Gemma's) must say so, or every text's first word becomes another token."""
    assert gguf_vocab._space_prefix(tok_json) is prefix


def test_conversion_cache_names_the_gguf_at_hand(tmp_path):
    """A cache made from a copy that moved points at the copy now used, so its tokenizer is reused."""
    folder, old, new = tmp_path / "cache", tmp_path / "old.gguf", tmp_path / "new.gguf"
    folder.mkdir()
    record_gguf_source(folder, old)
    record_gguf_source(folder, new)
    assert json.loads((folder / SOURCE_FILE).read_text()) == {"gguf": str(new.resolve())}
    assert [p.name for p in folder.iterdir()] == [SOURCE_FILE]  # no temporary left behind
