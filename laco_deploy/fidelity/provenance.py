"""What produced a fidelity report: library versions and hashes of the inputs."""

from __future__ import annotations

import hashlib
import importlib.metadata
import platform
from pathlib import Path

import torch

from laco_deploy import __version__
from laco_deploy.fsutil import sha256_tree

_DISTRIBUTIONS = ("transformers", "onnxruntime", "onnxruntime-gpu", "llama-cpp-python", "gguf", "numpy", "matplotlib",
                  "lm_eval")


def versions() -> dict[str, str]:
    """Versions of Python, laco-deploy, torch and the runtimes that are installed."""
    out = {"python": platform.python_version(), "laco_deploy": __version__, "torch": torch.__version__}
    for dist in _DISTRIBUTIONS:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def input_hash(path: Path | None) -> str | None:
    """sha256 of a model file, or of a model directory's files (names and contents)."""
    if path is None or not Path(path).exists():
        return None
    return sha256_tree(Path(path))


def tokens_hash(ids: torch.Tensor) -> str:
    """sha256 of the evaluation token ids (int64, row-major), so runs on the same tokens are recognisable."""
    return hashlib.sha256(ids.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()
