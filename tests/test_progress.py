"""Progress bars redirected to a log file stay short: no redraw per status update."""

from __future__ import annotations

import io
import sys

from laco_deploy.progress import progress_bar, set_status


def _redraws(stream: io.StringIO, monkeypatch) -> int:
    monkeypatch.setattr(sys, "stderr", stream)
    bar = progress_bar(range(20), desc="layers", file=stream)
    for i in bar:
        for step in range(10):
            set_status(bar, f"layer {i} step {step}")
    bar.close()
    return stream.getvalue().count("\r")


def test_log_output_is_throttled(monkeypatch):
    assert _redraws(io.StringIO(), monkeypatch) <= 4  # first draw, final draw, close


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_terminal_gets_every_status(monkeypatch):
    assert _redraws(_Terminal(), monkeypatch) >= 200
