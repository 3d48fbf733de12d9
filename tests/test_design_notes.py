"""docs/DESIGN.md's "where to change what" table: one file per row, and every file and test it
names exists (a renamed module or test shows up here, not in a newcomer's search)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _rows() -> list[list[str]]:
    text = (ROOT / "docs" / "DESIGN.md").read_text()
    table = text.split("## Where to change what", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in table.splitlines() if line.startswith("|")][2:]  # after the header and its rule
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]


def test_every_row_names_one_file_and_its_test():
    rows = _rows()
    assert len(rows) >= 15
    for what, where, test in rows:
        files = re.findall(r"`([\w/<>.]+\.py)`", where)
        assert len(files) == 1, (what, where)
        tests = re.findall(r"`(tests/[\w/]+\.py)`", test)
        assert len(tests) == 1, (what, test)
        if "<" not in files[0]:
            assert (ROOT / files[0]).is_file(), files[0]
        assert (ROOT / tests[0]).is_file(), tests[0]
