"""The floors of laco_deploy/ and exporters/, read from the source with ast (no heavy imports).

Every import of a project module counts, in functions too (a lazy import still ties two modules;
third-party imports may stay lazy). The graph has no circle, no module imports from a floor above
its own, and docs/DESIGN.md's drawing of the floors is the one `floors_drawing()` makes from FLOORS
(`python tests/test_import_graph.py` prints it). Entry points named as "module:attr" strings in
targets.py are looked up at run time (a registry handing each stage its exporter or runner) and are
not imports.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("laco_deploy", "exporters")
D = "laco_deploy."

# Bottom floor first. A module imports only from its own floor or those below; a name covers the
# module and, for a package, everything in it. Every module must sit on exactly one floor.
FLOORS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("contracts", ("laco_deploy", D + "errors", D + "config", D + "presets", D + "targets", D + "artifacts",
                   D + "families", D + "structured", D + "fsutil", D + "versions", D + "devices", D + "flops",
                   D + "memory", D + "isolated", D + "progress", D + "throughput", D + "distributed", D + "data", D + "divergence",
                   D + "budget_table")),
    ("models", (D + "modelcheck", D + "models", D + "gguf_convert", D + "sizing", D + "checked", D + "tokenizer")),
    ("engine, exporters", (D + "engine", "exporters")),
    ("runtimes", (D + "runtimes",)),
    ("stages", (D + "prune", D + "compensate", D + "fidelity", D + "imatrix")),
    ("benchmarks", (D + "bench",)),
    ("build", (D + "buildconfig", D + "budget", D + "stagecache", D + "summary", D + "memplan", D + "pipeline_stages",
               D + "pipeline")),
    ("cli", (D + "cli",)),
)


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _project_files() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def _targets(node: ast.Import | ast.ImportFrom, mod: str, is_pkg: bool, files: dict[str, Path]) -> list[str]:
    """The project modules one import statement names (`from pkg import name`: pkg.name when that is
    a module, else pkg; `import a.b.c` of an attribute: its module)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            anchor = mod.split(".") if is_pkg else mod.split(".")[:-1]
            anchor = anchor[: len(anchor) - node.level + 1]
            base = ".".join(anchor + ([base] if base else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
    out = []
    for t in names:
        while t and t not in files:
            t = t.rpartition(".")[0]
        if t:
            out.append(t)
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> project modules it imports anywhere in its source (module body, functions, classes).
    Importing a.b also runs a/__init__ first, unless the importer is inside a (already running)."""
    files = _project_files()
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for t in _targets(node, mod, path.name == "__init__.py", files):
                deps.add(t)
                parent = t.rpartition(".")[0]
                while parent:
                    if parent in files and not (mod + ".").startswith(parent + "."):
                        deps.add(parent)
                    parent = parent.rpartition(".")[0]
        deps.discard(mod)
        graph[mod] = deps
    return graph


def floor_of(mod: str) -> int:
    """Index in FLOORS of the longest name covering `mod`; -1 when none does."""
    best, floor = "", -1
    for i, (_, names) in enumerate(FLOORS):
        for name in names:
            if (mod == name or mod.startswith(name + ".")) and len(name) > len(best):
                best, floor = name, i
    return floor


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} ({FLOORS[floor_of(m)][0]}) -> {t} ({FLOORS[floor_of(t)][0]})"
                  for m, deps in graph.items() for t in deps if floor_of(t) > floor_of(m))


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


def floors_drawing() -> str:
    """FLOORS as text, top floor first (what docs/DESIGN.md shows)."""
    lines = []
    for name, members in reversed(FLOORS):
        short = [m.removeprefix(D) + ("/" if (ROOT / m.replace(".", "/") / "__init__.py").is_file() else "")
                 for m in members if m != "laco_deploy"]
        row = f"  {name:<18}|"
        for word in short:
            if len(row) + len(word) > 98:
                lines.append(row.rstrip())
                row = " " * 20 + "|"
            row += f" {word}"
        lines.append(row)
    return "\n".join(lines)


def test_find_cycles_sees_a_circle():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_function_level_imports_are_read():
    graph = import_graph()
    # cli/build_cmd.py imports pipeline inside its command function only
    assert "laco_deploy.pipeline" in graph["laco_deploy.cli.build_cmd"]
    assert "laco_deploy.engine.walk" in graph and "exporters.gguf" in graph


def test_no_import_circle():
    assert find_cycles(import_graph()) == []


def test_every_module_sits_on_one_floor():
    assert sorted(m for m in import_graph() if floor_of(m) < 0) == []


def test_upward_imports_are_seen():
    assert upward_imports({D + "models": {D + "engine.walk"}, D + "engine.walk": {D + "models"}}) == [
        "laco_deploy.models (models) -> laco_deploy.engine.walk (engine, exporters)"]


def test_no_upward_import():
    assert upward_imports(import_graph()) == []


# Imports between the stage packages: imatrix gathers pruning's input statistic (Wanda's), nothing else.
# imatrix: llama-imatrix's statistic is Wanda's (prune.stats); QA-LaCo through the importance-weighted
# quantizer computes the importance matrix its export then uses (compensate.quant_imatrix)
STAGES_MAY_SHARE = {(D + "imatrix", D + "prune"), (D + "imatrix", D + "prune.stats"),
                    (D + "compensate.stage", D + "imatrix")}


def _stage_package(mod: str) -> str:
    return ".".join(mod.split(".")[:2])


def test_stages_do_not_import_each_other():
    stages = FLOORS[[name for name, _ in FLOORS].index("stages")][1]
    graph = import_graph()
    across = {(m, t) for m, deps in graph.items() for t in deps
              if floor_of(m) == floor_of(t) and m.startswith(stages) and _stage_package(m) != _stage_package(t)}
    assert sorted(across - STAGES_MAY_SHARE) == []


def test_design_notes_draw_these_floors():
    design = (ROOT / "docs" / "DESIGN.md").read_text()
    assert floors_drawing() in design, "re-draw the floors in docs/DESIGN.md: python tests/test_import_graph.py"


# What exporters/ may use from laco_deploy: contracts, errors, files, format tables, the model
# loader (the ONNX exporter traces a loaded model) and memory (it trims the heap after tracing). Runners, data, the engine and the parity
# checks stay out, so an exporter is tested alone; targets.py hands it its runtime check.
EXPORTER_MAY_IMPORT = {"laco_deploy", "laco_deploy.artifacts", "laco_deploy.errors", "laco_deploy.families",
                       "laco_deploy.fsutil", "laco_deploy.memory", "laco_deploy.models", "laco_deploy.structured",
                       "laco_deploy.targets"}


def test_exporters_import_nothing_that_runs_models():
    used = {(m, t) for m, deps in import_graph().items() if m.startswith("exporters")
            for t in deps if t.split(".")[0] == "laco_deploy"}
    assert used, "the scan found no laco_deploy import at all"
    assert sorted((m, t) for m, t in used if t not in EXPORTER_MAY_IMPORT) == []


if __name__ == "__main__":
    print(floors_drawing())
