"""The check run right after a GGUF export that needs no runtime: read the file back with the
gguf package. The llama.cpp-vs-PyTorch parity check is laco_deploy.runtimes.parity.gguf_parity."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import gguf

from laco_deploy.errors import ExportError


def read_back(path: Path) -> dict[str, Any]:
    """What the gguf reader sees: architecture, tensor count and types, laco-deploy metadata."""
    try:
        reader = gguf.GGUFReader(str(path), "r")
    except Exception as e:  # the reader raises bare ValueError/struct errors on a bad file
        raise ExportError(f"the GGUF file just written ({path}) cannot be read back ({e}); check free disk space and retry") from e
    arch = reader.get_field("general.architecture")
    laco = {k: reader.get_field(k).contents() for k in reader.fields if k.startswith("laco_deploy.")}
    return {
        "architecture": arch.contents() if arch else None,
        "n_tensors": len(reader.tensors),
        "tensor_types": dict(Counter(t.tensor_type.name for t in reader.tensors)),
        "laco_deploy_keys": sorted(laco),
    }


def written_here(path: Path) -> bool:
    """Whether `path` is a GGUF file laco-deploy wrote (it carries laco_deploy.* keys): an export may
    replace it with --force; any other file is never replaced."""
    try:
        reader = gguf.GGUFReader(str(path), "r")
    except Exception:  # not a GGUF, or a broken one: not ours to replace
        return False
    return any(k.startswith("laco_deploy.") for k in reader.fields)
