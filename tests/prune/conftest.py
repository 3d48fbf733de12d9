"""Fixtures for the prune tests: a short calibration file so each tiny run takes about a second."""

from __future__ import annotations

import pytest

from laco_deploy.config import DataConfig
from laco_deploy.data import builtin_path


@pytest.fixture(scope="session")
def calib_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    path.write_text(builtin_path("calib").read_text(encoding="utf-8")[:20_000], encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def data_cfg(calib_file) -> DataConfig:
    """4 calibration samples of 32 tokens from a 20 kB slice of the builtin text."""
    return DataConfig(calib=str(calib_file), samples=4, seqlen=32)
