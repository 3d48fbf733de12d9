"""Rebuild the code half of the `builtin:mixed` calibration text (laco_deploy/data/builtin/calibration_code.jsonl).

`builtin:mixed` is the builtin Wikipedia calibration articles (calibration.txt) followed by the
whole source of the 36 CPython 3.11.7 standard-library modules below, about half of the characters
each. Calibrating LaCo on that mix instead of Wikipedia alone raised the worst out-of-domain gap
closed from 23% to 43% (benchmarks/RESULTS.md, "Mixed-domain calibration"). The Wikipedia half is
read from calibration.txt at load time rather than copied here, so the two never drift apart.

The modules are disjoint from the 18 of the `code` evaluation text (tools/make_domain_corpora.py):
calibration must never see evaluation text; `main` asserts it.

Usage (run by hand; the output depends only on CPython 3.11.7's Lib/):
    python3.11 tools/make_mixed_calibration.py [CPYTHON_LIB_DIR]
CPYTHON_LIB_DIR defaults to the running interpreter's standard library (which must be 3.11.7).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_domain_corpora import CODE_MODULES, _write_jsonl, code_docs, stdlib_dir  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "laco_deploy" / "data" / "builtin"
NAME = "calibration_code.jsonl"
# Pure-Python modules of many kinds (parsers, file formats, networking, concurrency, typing), none of
# the `code` evaluation text's; the order is the file's order.
CALIB_MODULES = (
    "argparse.py", "calendar.py", "cmd.py", "configparser.py", "dataclasses.py", "difflib.py",
    "enum.py", "fnmatch.py", "getopt.py", "gettext.py", "glob.py", "ipaddress.py", "locale.py",
    "logging/__init__.py", "mailbox.py", "optparse.py", "pathlib.py", "pickle.py", "platform.py",
    "random.py", "shutil.py", "smtplib.py", "socketserver.py", "subprocess.py", "tarfile.py",
    "tempfile.py", "threading.py", "timeit.py", "trace.py", "typing.py", "unittest/case.py",
    "urllib/parse.py", "uuid.py", "wave.py", "weakref.py", "zipfile.py",
)


def main(lib_dir: str | None = None) -> None:
    overlap = set(CALIB_MODULES) & set(CODE_MODULES)
    assert not overlap, f"calibration modules overlap the code evaluation text: {sorted(overlap)}"
    assert len(set(CALIB_MODULES)) == len(CALIB_MODULES), "a calibration module is listed twice"
    _write_jsonl(NAME, code_docs(stdlib_dir(lib_dir), CALIB_MODULES), OUT)


if __name__ == "__main__":
    main(*sys.argv[1:2])
