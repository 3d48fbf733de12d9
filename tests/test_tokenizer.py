"""load_tokenizer: transformers' tokenizer without the Python copies of its vocabulary and merges that
BPE families (Gemma, GPT-2) keep from their construction; the same encoding, decoding and saved files."""

from __future__ import annotations

import filecmp
import json

from transformers import AutoTokenizer

from laco_deploy.tokenizer import PYTHON_COPIES, load_tokenizer

TEXT = "The castle stood on the hill above the river, 1984 ünïcode\n  def f(x): return x"


def _gpt2_dir(bpe_tokenizer, path):
    """The tiny BPE tokenizer saved as a GPT2Tokenizer, a class transformers builds from vocab + merges."""
    bpe_tokenizer.save_pretrained(path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "GPT2Tokenizer"}))
    return path


def test_python_copies_are_released_and_nothing_else_changes(bpe_tokenizer, tmp_path):
    src = _gpt2_dir(bpe_tokenizer, tmp_path / "gpt2")
    as_loaded, released = AutoTokenizer.from_pretrained(src), load_tokenizer(src)
    assert all(isinstance(getattr(as_loaded, name), (dict, list)) for name in PYTHON_COPIES)  # what is dropped exists
    assert all(getattr(released, name) is None for name in PYTHON_COPIES)
    assert released(TEXT) == as_loaded(TEXT) and released.get_vocab() == as_loaded.get_vocab()
    ids = as_loaded(TEXT)["input_ids"]
    assert released.decode(ids) == as_loaded.decode(ids) and len(released) == len(as_loaded)
    as_loaded.save_pretrained(tmp_path / "a")
    released.save_pretrained(tmp_path / "b")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert filecmp.cmp(tmp_path / "a" / name, tmp_path / "b" / name, shallow=False)


def test_tokenizers_without_copies_load_as_they_are(tiny_llama_dir):
    tok = load_tokenizer(tiny_llama_dir)
    assert tok(TEXT) == AutoTokenizer.from_pretrained(tiny_llama_dir)(TEXT)
    assert not any(hasattr(tok, name) for name in PYTHON_COPIES)
