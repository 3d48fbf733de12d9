"""Flag names stay in the CLI: library messages name settings (`prune.offload`), cli/flags.py shows the
flag of the command that ran. Docstrings and comments may mention flags; string literals may not."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
# Messages that must quote another program's command line: (file, text around the flag).
ALLOWED = {
    ("laco_deploy/fidelity/tasks.py", "pip install --no-deps"),
    ("laco_deploy/models.py", "pip install --force-reinstall"),
    ("laco_deploy/distributed.py", "torchrun --nproc-per-node"),
    ("laco_deploy/bench/compare.py", "benchmarks/run_suite.py NAME --out"),
    ("exporters/llama_tools.py", "pip download --quiet"),
    ("exporters/llama_tools.py", "cmake --build"),
}


def _docstrings(tree: ast.AST) -> set[int]:
    nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))]
    return {id(n.body[0].value) for n in nodes
            if n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}


def flag_literals(root: Path = ROOT) -> list[str]:
    """`file:line: flag in text` for each flag-looking word in a non-docstring string literal of the library."""
    files = [*(root / "laco_deploy").rglob("*.py"), *(root / "exporters").rglob("*.py")]
    found = []
    for path in sorted(f for f in files if (root / "laco_deploy" / "cli") not in f.parents):
        rel = path.relative_to(root).as_posix()
        tree = ast.parse(path.read_text(), rel)
        skip = _docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
                for m in FLAG.finditer(node.value):
                    if not any(f == rel and around in node.value for f, around in ALLOWED):
                        found.append(f"{rel}:{node.lineno}: {m.group(0)} in {node.value[:80]!r}")
    return found


def test_library_strings_name_settings_not_flags():
    assert flag_literals() == []


def test_the_check_sees_a_flag(tmp_path):
    """The scan is not vacuous: a flag in an f-string part is found, one in a docstring or in cli/ is not."""
    for folder in ("laco_deploy/cli", "exporters"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "laco_deploy" / "m.py").write_text('"""Use --doc."""\ndef f(x):\n    raise ValueError(f"bad {x}; use --offload disk")\n')
    (tmp_path / "laco_deploy" / "cli" / "c.py").write_text('HELP = "--offload"\n')
    assert [line.split(" in ")[0] for line in flag_literals(tmp_path)] == ["laco_deploy/m.py:3: --offload"]
