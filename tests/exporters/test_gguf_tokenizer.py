"""GGUF tokenizers: BPE and SentencePiece vocabularies tokenize like the HF tokenizer in llama.cpp;
a model converted from a GGUF file keeps that file's tokenizer and general metadata."""

from __future__ import annotations

import json
import shutil

import gguf
import numpy as np
import pytest

from exporters.gguf_names import LLAMA3_SPLIT, QWEN2_SPLIT
from exporters.gguf_vocab import pre_tokenizer_name
from laco_deploy.data import load_texts

pytest.importorskip("llama_cpp")
from exporters.gguf import export  # noqa: E402
from laco_deploy.runtimes.llamacpp import LlamaCppRunner  # noqa: E402
from laco_deploy.runtimes.parity import gguf_parity

SAMPLES = ["Hello world", "In 1905, 3.14 and 12345 apples\n\n  indented\tline", "naïve café — «quotes» 東京",
           "<|im_start|>user\nhi<|im_end|>"]


def _texts():
    return SAMPLES + [load_texts("builtin", "eval")[1][:1500]]


def _check_tokenization(src, gguf_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src)
    runner = LlamaCppRunner(gguf_path, n_ctx=32)
    try:
        for text in _texts():
            assert runner.tokenize(text, parse_special=True) == tok.encode(text, add_special_tokens=True), text
    finally:
        runner.close()


def _field(path, key):
    f = gguf.GGUFReader(str(path)).get_field(key)
    return None if f is None else f.contents()


def test_pre_tokenizer_recognition():
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}
    assert pre_tokenizer_name(byte_level) == "gpt-2"
    digits = {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, byte_level]}
    assert pre_tokenizer_name(digits) == "smollm"
    for regex, name in ((LLAMA3_SPLIT, "llama-bpe"), (QWEN2_SPLIT, "qwen2")):
        seq = {"type": "Sequence", "pretokenizers": [{"type": "Split", "pattern": {"Regex": regex}},
                                                      {"type": "ByteLevel", "use_regex": False}]}
        assert pre_tokenizer_name(seq) == name
    assert pre_tokenizer_name({"type": "Whitespace"}) is None and pre_tokenizer_name(None) is None


def test_bpe_vocabulary(tiny_llama_dir, tmp_path):
    src = tmp_path / "chat"
    shutil.copytree(tiny_llama_dir, src)
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
    (src / "tokenizer_config.json").write_text(json.dumps(cfg))
    res = export(src, tmp_path / "bpe.gguf", "f16")
    tok_json = json.loads((src / "tokenizer.json").read_text())
    assert _field(res.path, "tokenizer.ggml.model") == "gpt2" and _field(res.path, "tokenizer.ggml.pre") == "gpt-2"
    tokens = _field(res.path, "tokenizer.ggml.tokens")
    assert len(tokens) == 512 and tokens[1] == "<|im_start|>"
    assert _field(res.path, "tokenizer.ggml.token_type")[:3] == [gguf.TokenType.CONTROL] * 3
    assert len(_field(res.path, "tokenizer.ggml.merges")) == len(tok_json["model"]["merges"])
    assert _field(res.path, "tokenizer.chat_template") == cfg["chat_template"]
    assert _field(res.path, "tokenizer.ggml.eos_token_id") == 0 and _field(res.path, "tokenizer.ggml.add_bos_token") is False
    _check_tokenization(src, res.path)


def test_qwen2_pre_tokenizer(tiny_qwen2_dir, tmp_path):
    res = export(tiny_qwen2_dir, tmp_path / "q.gguf", "f16")
    assert _field(res.path, "tokenizer.ggml.pre") == "qwen2"  # what transformers' Qwen2Tokenizer applies
    _check_tokenization(tiny_qwen2_dir, res.path)


def test_sentencepiece_model_vocabulary(tiny_llama_sp_dir, tmp_path):
    import sentencepiece as spm

    res = export(tiny_llama_sp_dir, tmp_path / "sp.gguf", "f16")
    sp = spm.SentencePieceProcessor(model_file=str(tiny_llama_sp_dir / "tokenizer.model"))
    assert _field(res.path, "tokenizer.ggml.model") == "llama"
    scores = _field(res.path, "tokenizer.ggml.scores")
    assert np.allclose(scores[: sp.vocab_size()], [sp.GetScore(i) for i in range(sp.vocab_size())])
    types = _field(res.path, "tokenizer.ggml.token_type")
    assert types[0] == gguf.TokenType.UNKNOWN and types[1] == gguf.TokenType.CONTROL
    assert all(types[i] == gguf.TokenType.BYTE for i in range(sp.vocab_size()) if sp.IsByte(i))
    assert _field(res.path, "tokenizer.ggml.bos_token_id") == 1
    _check_tokenization(tiny_llama_sp_dir, res.path)


def test_sentencepiece_from_tokenizer_json_only(tiny_llama_sp_dir, tmp_path):
    src = tmp_path / "json_only"
    shutil.copytree(tiny_llama_sp_dir, src)
    (src / "tokenizer.model").unlink()
    res = export(src, tmp_path / "spj.gguf", "f16")
    assert _field(res.path, "tokenizer.ggml.model") == "llama"
    _check_tokenization(src, res.path)


def _restamp(src_gguf, dst_gguf, **changes):
    """Copy a GGUF file, overriding some string keys (a stand-in for a GGUF from elsewhere)."""
    from exporters.gguf_vocab import _copy_field

    reader = gguf.GGUFReader(str(src_gguf))
    writer = gguf.GGUFWriter(str(dst_gguf), reader.get_field("general.architecture").contents())
    for key, field in reader.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture" and key not in changes:
            _copy_field(writer, key, field)
    for key, value in changes.items():
        writer.add_string(key, value)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_tokenizer_and_general_metadata_carried_from_source_gguf(tiny_llama_dir, tmp_path):
    plain = export(tiny_llama_dir, tmp_path / "plain.gguf", "f32")
    source = tmp_path / "source.gguf"
    _restamp(plain.path, source, **{"general.name": "Tiny Source", "general.license": "apache-2.0",
                                    "tokenizer.ggml.pre": "smollm"})
    src = tmp_path / "from_gguf"
    shutil.copytree(tiny_llama_dir, src)
    (src / "laco_source.json").write_text(json.dumps({"gguf": str(source)}))
    res = export(src, tmp_path / "carried.q8_0.gguf", "q8_0")
    assert _field(res.path, "general.name") == "Tiny Source" and _field(res.path, "general.license") == "apache-2.0"
    assert _field(res.path, "tokenizer.ggml.pre") == "smollm"
    assert _field(res.path, "tokenizer.ggml.tokens") == _field(source, "tokenizer.ggml.tokens")
    assert _field(res.path, "tokenizer.ggml.merges") == _field(source, "tokenizer.ggml.merges")
    assert _field(res.path, "general.file_type") == int(gguf.LlamaFileType.MOSTLY_Q8_0)  # the file's own type
    assert any("carried over" in n for n in res.notes)
    (src / "laco_source.json").write_text(json.dumps({"gguf": str(tmp_path / "gone.gguf")}))
    fallback = export(src, tmp_path / "fallback.gguf", "f16", check=gguf_parity)  # source gone: HF tokenizer instead
    assert _field(fallback.path, "general.name") == src.name and fallback.checks["tokenizer_match"]
