"""No import circle in laco_deploy/ and exporters/: module-level imports only (imports inside
functions are lazy by design), read from the source with ast so the test needs no heavy imports."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("laco_deploy", "exporters")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _toplevel_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Imports run when the module is imported: module body, also under if/try (not in functions,
    classes or `if TYPE_CHECKING:`)."""
    found, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
            todo += node.body + node.orelse
        elif isinstance(node, ast.Try):
            todo += node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body]
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> project modules it imports at import time. `from pkg import name` counts as an
    import of pkg.name when that is a module, else of pkg; importing pkg.sub also runs pkg."""
    files = {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        deps: set[str] = set()
        for node in _toplevel_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    anchor = anchor[: len(anchor) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            for t in targets:
                while t and t not in files:  # `import a.b.c` of a non-module attribute: its module
                    t = t.rpartition(".")[0]
                if not t:
                    continue
                deps.add(t)
                parent = t.rpartition(".")[0]
                while parent:  # importing a.b runs a/__init__ first, unless `mod` is inside a (already running)
                    if parent in files and not (mod + ".").startswith(parent + "."):
                        deps.add(parent)
                    parent = parent.rpartition(".")[0]
        deps.discard(mod)
        graph[mod] = deps
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_find_cycles_sees_a_circle():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle():
    graph = import_graph()
    assert "laco_deploy.engine.walk" in graph and "exporters.gguf" in graph
    assert find_cycles(graph) == []


# What exporters/ may use from laco_deploy: contracts, errors, files, format tables and the model
# loader (the ONNX exporter traces a loaded model). Runners, data, the engine and the parity
# checks stay out, so an exporter is tested alone; targets.py hands it its runtime check.
EXPORTER_MAY_IMPORT = {"laco_deploy", "laco_deploy.artifacts", "laco_deploy.errors", "laco_deploy.families",
                       "laco_deploy.fsutil", "laco_deploy.models", "laco_deploy.structured", "laco_deploy.targets"}


def test_exporters_import_nothing_that_runs_models():
    used = set()
    for path in (ROOT / "exporters").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):  # function-level imports too
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            used |= {(path.name, n) for n in names if n.split(".")[0] == "laco_deploy"}
    assert used, "the scan found no laco_deploy import at all"
    assert sorted((f, n) for f, n in used if n not in EXPORTER_MAY_IMPORT) == []
