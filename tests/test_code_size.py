"""Size limits of the library code (laco_deploy/ and exporters/), read with ast: no file over 400
lines and no function over 60, counted from its `def` line to its last line (signature, docstring
and nested functions included), so one screen holds it."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_FILE_LINES, MAX_FUNCTION_LINES = 400, 60


def _sources() -> list[Path]:
    return sorted(p for pkg in ("laco_deploy", "exporters") for p in (ROOT / pkg).rglob("*.py"))


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, int]]:
    return [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > limit]


def test_long_functions_are_seen():
    body = "".join(f"    x{i} = {i}\n" for i in range(60))
    assert long_functions(f"def f():\n{body}") == [("f", 61)]
    assert long_functions(f"def f():\n{body[: body.rindex('    x59')]}") == []


def test_no_file_over_400_lines():
    long = [(str(p.relative_to(ROOT)), n) for p in _sources() if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES]
    assert long == []


def test_no_function_over_60_lines():
    long = [(str(p.relative_to(ROOT)), name, n) for p in _sources() for name, n in long_functions(p.read_text())]
    assert long == []
