"""Checks of a model source from its files alone, before anything loads it (models.check_source).

What loading must never do unasked: run the model's own Python code (`auto_map` in config.json or
tokenizer_config.json: transformers would import the folder's *.py files, after an interactive
prompt when it is not told either way), or fail minutes into a run on a broken file (truncated
safetensors or GGUF, tensors whose shapes disagree with config.json, samples longer than the
model's context). Each is found here in milliseconds and reported in one line.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from laco_deploy import structured
from laco_deploy.errors import ConfigError, ModelError

CODE_CONFIGS = ("config.json", "tokenizer_config.json")  # where transformers looks for auto_map
_HEADER_LIMIT = 100 * 2**20  # safetensors' own limit on the JSON header


def custom_code(path: Path) -> dict[str, str]:
    """{file name: the classes it maps to the folder's own code} for every auto_map in `path`."""
    found = {}
    for name in CODE_CONFIGS:
        try:
            raw = json.loads((Path(path) / name).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError):
            continue  # config.json itself is checked by models._check_hf_dir; a bad tokenizer config fails on load
        auto_map = raw.get("auto_map") if isinstance(raw, dict) else None
        if auto_map:
            found[name] = ", ".join(sorted(auto_map)) if isinstance(auto_map, dict) else str(auto_map)
    return found


def check_custom_code(path: Path, trust_remote_code: bool | None) -> None:
    """Refuse a folder that ships its own model or tokenizer code, unless model.trust_remote_code is on
    (None: the caller has no such setting, e.g. export, which never runs a model's code)."""
    found = custom_code(path)
    if found and not trust_remote_code:
        where = "; ".join(f"{name} auto_map: {classes}" for name, classes in found.items())
        opt_in = ("" if trust_remote_code is None else
                  "set model.trust_remote_code only for a source you trust, or ")
        raise ModelError(f"{path} ships its own Python code ({where}), which loading it would run, and laco-deploy "
                         f"runs no model code unasked; {opt_in}remove auto_map to use transformers' own code for its family")


def pickle_refusal(path: Path, allow_pickle: bool | None) -> ModelError:
    """The error for a folder holding only pickled weights (None: the caller reads safetensors only)."""
    if allow_pickle is None:
        return ModelError(f"{path} holds only pickled weights (*.bin), and this reads safetensors only; re-save the "
                          "model with safetensors first (transformers: save_pretrained(DIR, safe_serialization=True))")
    return ModelError(f"{path} holds only pickled weights (*.bin), which can run arbitrary code when loaded; "
                      "convert them to safetensors, or turn on model.allow_pickle if you trust the source")


def check_gguf_readable(gguf: Path) -> None:
    """Fail early, in one line, on a truncated or non-GGUF file."""
    with open(gguf, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelError(f"{gguf} is not a GGUF file (bad magic {magic!r}); re-download or re-export it")
    try:
        from gguf import GGUFReader

        GGUFReader(str(gguf), "r")
    except Exception as e:  # the reader raises bare ValueError/IndexError/struct errors on corruption
        raise ModelError(f"{gguf} is a corrupt or truncated GGUF file ({type(e).__name__}: {e}); re-download or re-export it") from e


def check_safetensors(path: Path) -> None:
    """Every *.safetensors file in `path` has a readable header whose tensors fit in the file
    (a truncated download or copy is reported now, naming the file, not as a library error later)."""
    for file in sorted(Path(path).glob("*.safetensors")):
        problem = _safetensors_problem(file)
        if problem:
            raise ModelError(f"{file} is not a complete safetensors file ({problem}); re-download or re-save the model")


def check_shapes(path: Path) -> None:
    """Every tensor in the safetensors files has the shape config.json gives it (a model built on
    `meta` from the config, so no weights are read): a mismatch is one line naming the tensor, not a
    library error minutes later or a broken export."""
    expected = {k: tuple(v.shape) for k, v in structured.skeleton_of(path).state_dict().items()}
    for file in sorted(Path(path).glob("*.safetensors")):
        for name, shape in _header_shapes(file).items():
            if name in expected and shape != expected[name]:
                raise ModelError(f"{file}: tensor {name} has shape {list(shape)}, but {Path(path) / 'config.json'} makes it "
                                 f"{list(expected[name])}; the weights do not belong to this config: re-save the model "
                                 "or fix config.json")


def _header_shapes(file: Path) -> dict[str, tuple[int, ...]]:
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {k: tuple(t["shape"]) for k, t in header.items() if k != "__metadata__"}


def _safetensors_problem(file: Path) -> str | None:
    size = file.stat().st_size
    try:
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"{size} bytes, shorter than a header"
            (n,) = struct.unpack("<Q", head)
            if n > min(_HEADER_LIMIT, size - 8):
                return f"its header claims {n} bytes of {size - 8} available"
            header = json.loads(f.read(n))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return f"unreadable header: {e}"
    if not isinstance(header, dict):
        return "its header is not a JSON object"
    ends = [t.get("data_offsets", [0, 0])[1] for k, t in header.items() if k != "__metadata__" and isinstance(t, dict)]
    need = 8 + n + max(ends, default=0)
    if need > size:
        return f"{size} bytes, but its tensors need {need}"
    return None


def context_length(path: Path, gguf_file: bool = False) -> int | None:
    """The longest sequence the model was built for (config.json max_position_embeddings, or a GGUF's
    `{arch}.context_length`), or None when the files do not say."""
    try:
        if gguf_file:
            from gguf import GGUFReader

            reader = GGUFReader(str(path), "r")
            arch = reader.get_field("general.architecture").contents()
            field = reader.get_field(f"{arch}.context_length")
            return int(field.contents()) if field is not None else None
        raw = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
        value = raw.get("max_position_embeddings") or (raw.get("text_config") or {}).get("max_position_embeddings")
        return int(value) if value else None
    except Exception:  # unreadable files are reported by the source checks themselves
        return None


def check_seqlen(seqlen: int | None, context: int | None, what: str) -> None:
    """Refuse samples longer than the model's context before any text is tokenized or any layer runs."""
    if seqlen is not None and context is not None and seqlen > context:
        raise ConfigError(f"data.seqlen {seqlen} is longer than the {context} tokens {what} was built for "
                          f"(max_position_embeddings); use data.seqlen {context} or less")
