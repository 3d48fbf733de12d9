"""isolated.call: work in a spawned child whose result, errors, log lines and peak memory come back."""

from __future__ import annotations

import logging
import os
import signal
import time
import warnings

import pytest

from laco_deploy import isolated, memory
from laco_deploy.errors import ExportError, ResourceError

CHILD_MIB = 300


def _allocate_and_log(mib: int) -> int:
    """In the child: hold `mib` MiB (touched) for a few of the parent's samples of it, log a line,
    return this process's id."""
    block = bytearray(mib * 2**20)
    block[:: 4096] = b"x" * len(block[:: 4096])
    time.sleep(10 * memory.CHILDREN_EVERY * memory.SAMPLE_S)
    logging.getLogger("laco_deploy.test_child").warning("child holds %d MiB", mib)
    warnings.warn("a library's warning in the child", FutureWarning)  # to the log, not to stderr
    return os.getpid()


def _refuse(path: str) -> None:
    raise ExportError(f"cannot export {path}: a reason the user can fix")


def _killed() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def test_result_log_lines_and_peak_come_back(caplog, capfd):
    mib = memory.current_rss_bytes() // 2**20 + CHILD_MIB  # more than this process holds
    with caplog.at_level(logging.WARNING), memory.measure("cpu") as m:
        before = memory.current_rss_bytes()
        child_pid = isolated.call(_allocate_and_log, mib)
        after = memory.current_rss_bytes()
    assert child_pid != os.getpid()
    assert f"child holds {mib} MiB" in caplog.text and "a library's warning in the child" in caplog.text
    assert "warning in the child" not in capfd.readouterr().err
    assert after - before < CHILD_MIB * 2**20 / 2  # the child's memory never was this process's
    # but the stage's peak counts it, on top of this process's own, resident all along
    assert m.peak_bytes >= before + mib * 2**20


def test_the_childs_error_is_raised_with_its_type():
    with pytest.raises(ExportError, match="cannot export model-dir: a reason the user can fix"):
        isolated.call(_refuse, "model-dir")


def test_a_killed_child_is_a_clear_error():
    with pytest.raises(ResourceError, match="killed .SIGKILL., most likely out of memory"):
        isolated.call(_killed)
