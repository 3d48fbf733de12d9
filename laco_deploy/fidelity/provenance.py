"""What produced a fidelity report: library versions and hashes of the inputs."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from laco_deploy.fsutil import sha256_tree
from laco_deploy.versions import package_versions as versions  # noqa: F401  (the one collector)


def input_hash(path: Path | None) -> str | None:
    """sha256 of a model file, or of a model directory's files (names and contents)."""
    if path is None or not Path(path).exists():
        return None
    return sha256_tree(Path(path))


def tokens_hash(ids: torch.Tensor) -> str:
    """sha256 of the evaluation token ids (int64, row-major), so runs on the same tokens are recognisable."""
    return hashlib.sha256(ids.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()
