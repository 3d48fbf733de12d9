"""Tokenizer metadata for GGUF: carried over from a source GGUF, or built from the HF tokenizer.

Three HF kinds are supported, as llama.cpp's converter handles them:
- GPT-2-style byte-level BPE (tokenizer.json, no byte fallback) -> `tokenizer.ggml.model = gpt2`
  with tokens, token types, merges and a pre-tokenizer name (`tokenizer.ggml.pre`);
- SentencePiece with tokenizer.model -> `llama` with the model's pieces, scores and types;
- Llama-style BPE with byte fallback in tokenizer.json only -> `llama`, scores from merge ranks
  (llama.cpp's SentencePiece tokenizer merges the best-scoring adjacent pair first, so a score
  of -rank reproduces BPE's lowest-rank-first order).
Special token ids and the chat template come from `gguf.SpecialVocab`, merges from the loaded
tokenizer (its tokenizers-library JSON); whether BOS/EOS
are added is taken from what the HF tokenizer actually does.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import gguf

from exporters.gguf_names import GENERAL_NOT_CARRIED, PRE_TOKENIZERS
from laco_deploy.errors import ExportError

log = logging.getLogger(__name__)

_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def carry_from_gguf(writer: gguf.GGUFWriter, source: Path, n_vocab: int) -> bool:
    """Copy `tokenizer.*` and `general.*` keys of `source` unchanged. False if it does not fit."""
    try:
        reader = gguf.GGUFReader(str(source), "r")
    except (OSError, ValueError) as e:
        log.warning("source GGUF %s unreadable (%s); building the tokenizer from the HF files", source, e)
        return False
    tokens = reader.get_field("tokenizer.ggml.tokens")
    if tokens is None or len(tokens.data) != n_vocab:
        return False
    for key, field in reader.fields.items():
        carried = key.startswith("tokenizer.") or (key.startswith("general.") and key not in GENERAL_NOT_CARRIED)
        if carried:
            _copy_field(writer, key, field)
    return True


def _copy_field(writer: gguf.GGUFWriter, key: str, field) -> None:
    """Re-add one reader field with its original value type; strings as raw bytes."""
    vtype = field.types[0]
    if vtype == gguf.GGUFValueType.ARRAY:
        sub = field.types[-1]
        if sub == gguf.GGUFValueType.STRING:
            value = [bytes(field.parts[i]) for i in field.data]
        else:
            value = field.contents()
        writer.add_key_value(key, value, vtype, sub_type=sub)
    elif vtype == gguf.GGUFValueType.STRING:
        writer.add_key_value(key, bytes(field.parts[-1]), vtype)
    else:
        writer.add_key_value(key, field.contents(), vtype)


def write_hf_tokenizer(writer: gguf.GGUFWriter, model_dir: Path, n_vocab: int) -> list[str]:
    """Write the tokenizer of an HF directory; returns notes for the export result.

    The tokenizers-library JSON is taken from the tokenizer as transformers loads it (some
    classes, e.g. Qwen2Tokenizer, replace the pre-tokenizer stored in tokenizer.json).
    """
    tok = _load_hf_tokenizer(model_dir)
    tok_json = _backend_json(tok) or _read_json(model_dir / "tokenizer.json")
    kind = (tok_json or {}).get("model", {}).get("type")
    notes: list[str] = []
    if (model_dir / "tokenizer.model").is_file():
        tokens, scores, types = _sentencepiece_vocab(model_dir, n_vocab, tok_json)
        _write_llama_vocab(writer, tokens, scores, types, tok_json)
    elif tok_json is None:
        raise ExportError(f"{model_dir} has neither tokenizer.json nor tokenizer.model; save the tokenizer "
                          "next to the weights (tokenizer.save_pretrained)")
    elif kind == "BPE" and tok_json["model"].get("byte_fallback"):
        tokens, scores, types = _json_llama_vocab(tok_json, n_vocab)
        _write_llama_vocab(writer, tokens, scores, types, tok_json)
    elif kind == "BPE":
        tokens, types = _bpe_vocab(tok_json, n_vocab)
        pre = pre_tokenizer_name(tok_json.get("pre_tokenizer"))
        if pre is None:
            pre = "default"
            notes.append("pre-tokenizer not recognised; wrote tokenizer.ggml.pre=default (see checks for the "
                         "tokenizer match against the HF tokenizer)")
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(_merges(tok_json))
    else:
        raise ExportError(f"tokenizer model {kind!r} in {model_dir} is not supported for GGUF; "
                          "supported: byte-level BPE (GPT-2 style) and SentencePiece/Llama BPE")
    special = gguf.SpecialVocab(model_dir, load_merges=False, n_vocab=n_vocab)
    special.add_special_token.clear()  # replaced by the observed behaviour below
    special.add_to_gguf(writer, quiet=True)
    add_bos, add_eos = _observed_special_tokens(tok)
    writer.add_add_bos_token(add_bos)
    writer.add_add_eos_token(add_eos)
    return notes


def _load_hf_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
    except (OSError, ValueError, TypeError) as e:
        reason = " ".join(str(e).split())
        raise ExportError(f"cannot load the tokenizer in {model_dir} ({reason}); save it with tokenizer.save_pretrained") from e


def _backend_json(tok) -> dict | None:
    backend = getattr(tok, "backend_tokenizer", None)
    return json.loads(backend.to_str()) if backend is not None else None


def _merges(tok_json: dict) -> list[str]:
    """BPE merges as "left right" strings; a space inside a part is written as U+0120+... (chr(32+256))."""
    out = []
    for m in tok_json["model"].get("merges", []):
        if isinstance(m, str):
            out.append(m)
        else:
            out.append(" ".join("".join(chr(ord(c) + 256) if c == " " else c for c in part) for part in m))
    return out


def pre_tokenizer_name(pre: dict | None) -> str | None:
    """llama.cpp pre-tokenizer name for an HF tokenizer.json `pre_tokenizer`, or None."""
    if not pre:
        return None
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    for name, matches in PRE_TOKENIZERS:
        if matches(steps):  # type: ignore[operator]
            return name
    return None


def _read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ExportError(f"{path} is not valid JSON ({e}); re-save the tokenizer") from e


def _added_tokens(tok_json: dict | None) -> dict[int, dict]:
    return {int(t["id"]): t for t in (tok_json or {}).get("added_tokens", [])}


def _added_type(entry: dict) -> int:
    return gguf.TokenType.CONTROL if entry.get("special") else gguf.TokenType.USER_DEFINED


def _bpe_vocab(tok_json: dict, n_vocab: int) -> tuple[list[str], list[int]]:
    """Byte-level BPE: token strings (byte-to-unicode form, as in tokenizer.json) and types."""
    by_id = {i: t for t, i in tok_json["model"]["vocab"].items()}
    added = _added_tokens(tok_json)
    tokens, types = [], []
    for i in range(n_vocab):
        if i in added:
            tokens.append(added[i]["content"])
            types.append(_added_type(added[i]))
        elif i in by_id:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
        else:  # embedding rows beyond the tokenizer (padded vocabularies)
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    return tokens, types


def _sentencepiece_vocab(model_dir: Path, n_vocab: int, tok_json: dict | None) -> tuple[list[bytes], list[float], list[int]]:
    """Pieces, scores and types from tokenizer.model, plus tokens added on top (tokenizer.json)."""
    from sentencepiece import SentencePieceProcessor

    sp = SentencePieceProcessor()
    try:
        sp.LoadFromFile(str(model_dir / "tokenizer.model"))
    except (OSError, RuntimeError) as e:
        raise ExportError(f"{model_dir}/tokenizer.model is not a SentencePiece model ({e}); re-save the tokenizer") from e
    tokens = [f"[PAD{i}]".encode() for i in range(n_vocab)]
    scores, types = [-1000.0] * n_vocab, [int(gguf.TokenType.UNUSED)] * n_vocab
    for i in range(min(sp.vocab_size(), n_vocab)):
        tokens[i], scores[i] = sp.IdToPiece(i).encode("utf-8"), sp.GetScore(i)
        types[i] = _sp_type(sp, i)
    for i, entry in _added_tokens(tok_json).items():
        if i < n_vocab and (i >= sp.vocab_size() or entry.get("special") and types[i] == gguf.TokenType.NORMAL):
            tokens[i], scores[i], types[i] = entry["content"].encode("utf-8"), -1000.0, _added_type(entry)
    return tokens, scores, types


def _sp_type(sp, i: int) -> int:
    if sp.IsUnknown(i):
        return gguf.TokenType.UNKNOWN
    if sp.IsControl(i):
        return gguf.TokenType.CONTROL
    if sp.IsUnused(i):
        return gguf.TokenType.UNUSED
    if sp.IsByte(i):
        return gguf.TokenType.BYTE
    return gguf.TokenType.NORMAL


def _json_llama_vocab(tok_json: dict, n_vocab: int) -> tuple[list[bytes], list[float], list[int]]:
    """Llama-style BPE with byte fallback from tokenizer.json: score = -(merge rank)."""
    model = tok_json["model"]
    merges = model.get("merges", [])
    rank = {}
    for r, m in enumerate(merges):
        a, b = m if isinstance(m, list) else m.split(" ", 1)
        rank.setdefault(a + b, r)
    floor = -float(len(merges) + 1)  # below every merge: never preferred when pairing symbols
    by_id = {i: t for t, i in model["vocab"].items()}
    added = _added_tokens(tok_json)
    tokens = [f"[PAD{i}]".encode() for i in range(n_vocab)]
    scores, types = [-1000.0] * n_vocab, [int(gguf.TokenType.UNUSED)] * n_vocab
    for i in range(n_vocab):
        if i in added:
            tokens[i], types[i] = added[i]["content"].encode("utf-8"), _added_type(added[i])
        elif i in by_id:
            text = by_id[i]
            tokens[i] = text.encode("utf-8")
            scores[i] = -float(rank[text]) if text in rank else (0.0 if len(text) == 1 else floor)
            if _BYTE_TOKEN.fullmatch(text):
                types[i] = gguf.TokenType.BYTE
            elif text == model.get("unk_token"):
                types[i] = gguf.TokenType.UNKNOWN
            else:
                types[i] = gguf.TokenType.NORMAL
    return tokens, scores, types


def _write_llama_vocab(writer, tokens, scores, types, tok_json: dict | None) -> None:
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    prefix = _space_prefix(tok_json)
    if prefix is not None:
        writer.add_add_space_prefix(prefix)


def _space_prefix(tok_json: dict | None) -> bool | None:
    """Whether a leading '▁' is prepended (Metaspace prepend_scheme or a Prepend normalizer); None
    without tokenizer.json. Said either way: llama.cpp's default for this vocabulary is to prepend,
    which for Gemma's (a Replace normalizer, nothing prepended) shifted every first word."""
    if not tok_json:
        return None
    pre = tok_json.get("pre_tokenizer") or {}
    for step in pre.get("pretokenizers", [pre]):
        if step.get("type") == "Metaspace":
            scheme = step.get("prepend_scheme", "always" if step.get("add_prefix_space", True) else "never")
            return scheme != "never"
    norm = tok_json.get("normalizer") or {}
    for step in norm.get("normalizers", [norm]):
        if step.get("type") == "Prepend":
            return True
    return False


def _observed_special_tokens(tok) -> tuple[bool, bool]:
    """(adds BOS, adds EOS) as the HF tokenizer does when encoding plain text."""
    plain = tok.encode("hello world", add_special_tokens=False)
    full = tok.encode("hello world", add_special_tokens=True)
    start = next((s for s in range(len(full) - len(plain) + 1) if full[s : s + len(plain)] == plain), None)
    if start is None:  # special tokens interleaved with the text: cannot tell, assume none
        return False, False
    add_bos = start > 0 and tok.bos_token_id is not None and full[0] == tok.bos_token_id
    add_eos = start + len(plain) < len(full) and tok.eos_token_id is not None and full[-1] == tok.eos_token_id
    return add_bos, add_eos
