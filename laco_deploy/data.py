"""Calibration and evaluation text -> fixed-length token samples, deterministically from a seed.

Sources: `builtin` (Wikipedia text shipped in the package, calibration and evaluation disjoint),
`builtin:mixed` (calibration-only: the builtin Wikipedia calibration articles followed by Python
standard-library source, data/builtin/calibration_code.jsonl; recovery then transfers better to
other genres), `builtin:DOMAIN` (evaluation-only texts of other domains shipped in data/domains/,
never used for calibration, so reports show how recovery transfers to text unlike the calibration
data), a local `.txt` (documents separated by blank lines) or `.jsonl` (a "text" field per line),
and `hf:NAME[:CONFIG][:SPLIT]` through `datasets` when online.
"""

from __future__ import annotations

import json
import logging
import os
from importlib import resources
from pathlib import Path

import torch

from laco_deploy.errors import DataError

log = logging.getLogger(__name__)

BUILTIN = "builtin"
ALL_DOMAINS = "domains"  # evaluation spec: builtin (in-domain) plus every shipped out-of-domain text
IN_DOMAIN_LABEL = "wikipedia"  # what `builtin` evaluation text is, in reports
_BUILTIN_FILES = {"calib": "calibration.txt", "eval": "evaluation.txt"}
# calibration-only builtin mixes: name -> files read in order (the Wikipedia calibration articles first)
CALIB_MIXES = {"mixed": ("calibration.txt", "calibration_code.jsonl")}
# evaluation texts whose genre a builtin mix calibrates on (other documents of it): reports count them
# in-domain, so out-of-domain means a genre calibration never saw
MIX_GENRES = {"mixed": (BUILTIN, f"{BUILTIN}:code")}


def builtin_path(role: str) -> Path:
    return _builtin_file(_BUILTIN_FILES[role])


def _builtin_file(name: str) -> Path:
    return Path(str(resources.files("laco_deploy").joinpath("data", "builtin", name)))


def builtin_files(spec: str, role: str) -> list[Path]:
    """The shipped files a builtin spec reads (for fingerprints); [] when `spec` is not builtin."""
    if spec == BUILTIN:
        return [builtin_path(role)]
    name = _builtin_name(spec)
    if name in CALIB_MIXES:
        return [_builtin_file(f) for f in CALIB_MIXES[name]]
    if name in shipped_domains():
        return [_domains_dir() / f"{name}.jsonl"]
    return []


def fingerprint(spec: str, role: str) -> str:
    """Content hash of the texts `spec` reads for `role` (builtin files, a file or folder; other specs
    by name), for the reuse key of build stages and resumed walks."""
    from laco_deploy.fsutil import sha256_tree

    if files := builtin_files(spec, role):
        return ":".join(sha256_tree(f) for f in files)
    path = Path(spec).expanduser()
    return sha256_tree(path) if path.exists() else f"spec:{spec}"


def _domains_dir() -> Path:
    return Path(str(resources.files("laco_deploy").joinpath("data", "domains")))


def shipped_domains() -> list[str]:
    """Names of the out-of-domain evaluation texts shipped in data/domains/ (sorted): code, dialogue, fiction, techdoc."""
    folder = _domains_dir()
    return sorted(p.stem for p in folder.glob("*.jsonl")) if folder.is_dir() else []


def in_domain(eval_spec: str, calib_spec: str) -> bool:
    """Whether evaluation text `eval_spec` is of a genre the calibration `calib_spec` covers: the same
    spec, or a genre of a builtin mix (builtin:mixed calibrates on Wikipedia and Python source)."""
    return eval_spec == calib_spec or eval_spec in MIX_GENRES.get(_builtin_name(calib_spec), ())


def _builtin_name(spec: str) -> str | None:
    """NAME of a `builtin:NAME` spec, else None."""
    return spec.split(":", 1)[1] if spec.startswith(BUILTIN + ":") else None


def eval_specs(spec: str) -> list[str]:
    """An evaluation setting -> the list of text specs it names.

    `domains` expands to builtin (in-domain) + builtin:NAME for every shipped domain; a comma
    separates several specs (e.g. `builtin,notes.txt`).
    """
    specs: list[str] = []
    for part in (p.strip() for p in spec.split(",")):
        if part == ALL_DOMAINS:
            specs += [BUILTIN] + [f"{BUILTIN}:{name}" for name in shipped_domains()]
        elif part:
            specs.append(part)
    if not specs:
        raise DataError(f"evaluation setting {spec!r} names no text; use builtin, domains, a file or hf:NAME")
    return list(dict.fromkeys(specs))


def domain_label(spec: str) -> str:
    """Short name of an evaluation spec for tables: wikipedia, fiction, notes (file stem), ..."""
    if spec == BUILTIN:
        return IN_DOMAIN_LABEL
    if spec.startswith(BUILTIN + ":"):
        return spec.split(":", 1)[1]
    if spec.startswith("hf:"):
        return spec[3:].replace(":", "/")
    return Path(spec).stem


def eval_domains(spec: str = ALL_DOMAINS) -> list[tuple[str, str]]:
    """(label, spec) for each evaluation text of `spec`; the first is the in-domain one when builtin."""
    return [(domain_label(s), s) for s in eval_specs(spec)]


def _read_domain(spec: str, role: str) -> list[str]:
    name = spec.split(":", 1)[1]
    if name in CALIB_MIXES:
        return _read_mix(spec, name, role)
    mixes = ", ".join(f"builtin:{m}" for m in CALIB_MIXES)
    if name not in shipped_domains():
        raise DataError(f"no builtin text {name!r}; evaluation domains: {', '.join(shipped_domains()) or '(none shipped)'}; "
                        f"calibration: builtin, {mixes}")
    if role != "eval":
        raise DataError(f"{spec} is an evaluation-only text (it measures transfer to unseen domains); "
                        f"calibrate on builtin, {mixes}, a .txt/.jsonl file or hf:NAME")
    return _read_jsonl(_domains_dir() / f"{name}.jsonl")  # JSON Lines: code and docs keep their blank lines


def _read_mix(spec: str, name: str, role: str) -> list[str]:
    # a mix holds the builtin calibration articles: scoring on it would measure the training text
    if role != "calib":
        raise DataError(f"{spec} is a calibration-only text (it holds the builtin calibration articles); "
                        "evaluate on builtin, domains, builtin:DOMAIN, a file or hf:NAME")
    docs: list[str] = []
    for path in builtin_files(spec, role):
        docs += _read_jsonl(path) if path.suffix == ".jsonl" else _read_txt(path)
    return docs


def load_texts(spec: str, role: str = "calib") -> list[str]:
    """Documents from a source spec. `role` picks the builtin split ("calib" or "eval")."""
    if spec == BUILTIN:
        return _read_txt(builtin_path(role))
    if spec.startswith(BUILTIN + ":"):
        return _read_domain(spec, role)
    if spec == ALL_DOMAINS or "," in spec:
        raise DataError(f"{spec!r} names several texts; this step reads one: pass builtin, builtin:DOMAIN, a file or hf:NAME")
    if spec.startswith("hf:"):
        return _read_hf(spec)
    path = Path(spec).expanduser()
    if not path.exists():
        raise DataError(f"data file {spec} not found; pass an existing .txt or .jsonl file, 'builtin', or hf:NAME[:CONFIG][:SPLIT]")
    if path.is_dir():
        raise DataError(f"{spec} is a directory; pass a .txt or .jsonl file")
    if path.suffix.lower() == ".jsonl":
        docs = _read_jsonl(path)
    else:
        docs = _read_txt(path)
    if not docs:
        raise DataError(f"{spec} holds no text; give it at least one non-empty document")
    return docs


def check_texts(spec: str, role: str = "calib") -> None:
    """Read every local text a setting names (calibration: one; evaluation: each comma-separated part)
    so that a missing, empty or malformed file is reported before any model is loaded. Hub datasets
    (`hf:`) are left to the loader: checking them means downloading them."""
    for part in eval_specs(spec) if role == "eval" else [spec]:
        if not part.startswith("hf:"):
            load_texts(part, role)


def _read_txt(path: Path) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}); convert it to UTF-8") from e
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror or e}") from e
    return [d.strip() for d in text.split("\n\n") if d.strip()]


def _read_jsonl(path: Path) -> list[str]:
    try:
        return _parse_jsonl(path)
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 text ({e.reason}); convert it to UTF-8") from e
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror or e}") from e


def _parse_jsonl(path: Path) -> list[str]:
    docs = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n} is not valid JSON ({e.msg}); each line must be an object with a \"text\" field") from e
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise DataError(f"{path}:{n} has no string \"text\" field; each line must look like {{\"text\": \"...\"}}")
            if obj["text"].strip():
                docs.append(obj["text"].strip())
    return docs


def _read_hf(spec: str) -> list[str]:
    parts = spec[3:].split(":")
    if not parts[0]:
        raise DataError(f"{spec!r}: expected hf:NAME[:CONFIG][:SPLIT], e.g. hf:wikitext:wikitext-2-raw-v1:test")
    name, config, split = parts[0], (parts[1] if len(parts) > 1 and parts[1] else None), (parts[2] if len(parts) > 2 else "train")
    hint = f"cannot load dataset {name!r} from the Hugging Face Hub (offline?); save the text to a .txt or .jsonl file and pass its path"
    if os.environ.get("HF_DATASETS_OFFLINE") == "1" or os.environ.get("HF_HUB_OFFLINE") == "1":
        raise DataError(hint)
    try:
        import datasets

        ds = datasets.load_dataset(name, config, split=split)
    except Exception as e:  # connection and not-found errors come in many types
        raise DataError(hint) from e
    column = "text" if "text" in ds.column_names else ds.column_names[0]
    return [t for t in ds[column] if isinstance(t, str) and t.strip()]


# Bump when the way samples and windows are cut changes: stage reuse keys and reports record it, so
# cached stages rerun on the new tokens. 2: every sample starts as the tokenizer starts a sequence.
SAMPLE_FORMAT = 2


def sequence_affixes(tokenizer) -> tuple[list[int], list[int]]:
    """(prefix, suffix): the special tokens the tokenizer puts around a text it encodes for the model.

    [BOS] / [] for Llama, Gemma and SentencePiece tokenizers; [] / [] for GPT-2-style ones (SmolLM2).
    Read from what `tokenizer(text)` adds to the bare encoding, so a tokenizer's own settings
    (`add_bos_token`, a post-processor) decide, not a list of families."""
    probe = "The text"
    full = list(tokenizer(probe)["input_ids"])
    bare = list(tokenizer(probe, add_special_tokens=False)["input_ids"])
    for i in range(len(full) - len(bare) + 1):
        if full[i:i + len(bare)] == bare:
            return full[:i], full[i + len(bare):]
    raise DataError(f"the tokenizer encodes {probe!r} differently with and without its special tokens "
                    f"({full} vs {bare}); pass a tokenizer whose special tokens only wrap the text")


def sample_format(tokenizer) -> dict:
    """How samples are cut for this tokenizer, for records and reuse keys."""
    prefix, suffix = sequence_affixes(tokenizer)
    return {"version": SAMPLE_FORMAT, "prefix": prefix, "separator": _separator(tokenizer, suffix)}


def _separator(tokenizer, suffix: list[int]) -> list[int]:
    """Tokens between documents: what the tokenizer appends, else EOS (GPT-2 style), else nothing."""
    if suffix:
        return suffix
    return [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []


def _token_stream(tokenizer, docs: list[str]) -> torch.Tensor:
    """All documents as one 1-D stream, each encoded as the model sees a sequence: the tokenizer's
    prefix (BOS where it adds one), the text, then its suffix or EOS."""
    prefix, suffix = sequence_affixes(tokenizer)
    sep = _separator(tokenizer, suffix)
    ids: list[int] = []
    for doc in docs:
        ids += prefix
        ids.extend(tokenizer(doc, add_special_tokens=False)["input_ids"])
        ids += sep
    return torch.tensor(ids, dtype=torch.long)


def _window(stream: torch.Tensor, start: int, seqlen: int, prefix: list[int]) -> tuple[torch.Tensor, int]:
    """The sample of `seqlen` tokens starting at `start`, and how many stream tokens it used.

    A sample that starts inside a document gets the prefix (BOS) first, as every sequence the
    model sees does; one that starts at a document's own prefix uses it as is. [seqlen] int64."""
    n = len(prefix)
    if not n or stream[start:start + n].tolist() == prefix:
        return stream[start:start + seqlen], seqlen
    head = torch.tensor(prefix, dtype=torch.long)
    return torch.cat([head, stream[start:start + seqlen - n]]), seqlen - n


def calibration_samples(tokenizer, spec: str, samples: int, seqlen: int, seed: int) -> torch.Tensor:
    """`samples` random windows of `seqlen` tokens. [samples, seqlen] int64; same seed, same windows.
    Each starts as the tokenizer starts a sequence (BOS where it adds one)."""
    stream = _token_stream(tokenizer, load_texts(spec, "calib"))
    prefix, _ = sequence_affixes(tokenizer)
    if stream.numel() < seqlen or seqlen <= len(prefix):
        raise DataError(f"calibration text {spec} has {stream.numel()} tokens, fewer than one sample of data.seqlen {seqlen}; add text or lower data.seqlen")
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, stream.numel() - seqlen + 1, (samples,), generator=gen)
    return torch.stack([_window(stream, s, seqlen, prefix)[0] for s in starts.tolist()])


def evaluation_windows(tokenizer, spec: str, windows: int, seqlen: int) -> torch.Tensor:
    """The first `windows` non-overlapping windows of the evaluation text. [n, seqlen] int64.

    Contiguous and seed-free so every model and runtime is scored on exactly the same tokens; each
    window starts as the tokenizer starts a sequence (a window cut inside a document gets BOS first).
    Returns fewer windows when the text is shorter (at least one).
    """
    stream = _token_stream(tokenizer, load_texts(spec, "eval"))
    prefix, _ = sequence_affixes(tokenizer)
    out, pos = [], 0
    while len(out) < windows and seqlen > len(prefix) and pos + seqlen <= stream.numel():
        w, used = _window(stream, pos, seqlen, prefix)
        out.append(w)
        pos += used
    if not out:
        raise DataError(f"evaluation text {spec} has {stream.numel()} tokens, fewer than one window of {seqlen}; add text or lower data.seqlen")
    if len(out) < windows:
        log.warning("evaluation text holds only %d windows of %d tokens (asked for %d)", len(out), seqlen, windows)
    return torch.stack(out)


def evaluation_stream(tokenizer, spec: str, max_tokens: int | None = None) -> torch.Tensor:
    """The evaluation text as one token stream, starting as the tokenizer starts a sequence
    (parity checks score its head)."""
    stream = _token_stream(tokenizer, load_texts(spec, "eval"))
    if stream.numel() == 0:
        raise DataError(f"evaluation text {spec} is empty")
    return stream if max_tokens is None else stream[:max_tokens]
