"""Session fixtures: pruned tiny models (see compensate_sparse.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from compensate_sparse import make_structured, make_unstructured  # noqa: E402


@pytest.fixture(scope="session")
def sparse_unstructured_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    return make_unstructured(tiny_llama_dir, tmp_path_factory.mktemp("sp") / "unstructured")


@pytest.fixture(scope="session")
def sparse_24_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    return make_unstructured(tiny_llama_dir, tmp_path_factory.mktemp("sp") / "nm24", nm=(2, 4))


@pytest.fixture(scope="session")
def sparse_structured_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    return make_structured(tiny_llama_dir, tmp_path_factory.mktemp("sp") / "structured", keep_ffn=96)
