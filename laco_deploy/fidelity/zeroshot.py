"""Zero-shot accuracy through lm-evaluation-harness, on PyTorch models loaded one at a time.

The harness is the engine: its HFLM wrapper (harness_lm.ContinuationLM: the LM head only where the
harness reads logits) takes our transformers model object (so structured-pruned models with per-layer
widths, which `models.load_model` rebuilds, run as loaded) and the dense model's
tokenizer (every candidate is asked the same token sequences), and its evaluator scores the tasks
(loglikelihood of each choice; acc, acc_norm and their standard errors). Tasks are built once
(`tasks.load_tasks`) and scored with 0 few-shot examples for every model.

Only PyTorch models run here: GGUF and ONNX candidates are skipped with one log line each.

The record this returns is what fidelity.json holds under "zeroshot" (schema.json): per task and model
the harness's metrics with their standard errors, and per model the mean of each metric over the tasks
that report it, with the standard error of that mean (tasks taken as independent).
"""

from __future__ import annotations

import contextlib
import gc
import importlib.metadata
import io
import logging
import math
import os
import time
from typing import Any

import torch

from laco_deploy.config import FidelityConfig
from laco_deploy.fidelity.tasks import LoadedTasks
from laco_deploy.memory import trim_heap
from laco_deploy.sizing import zeroshot_batch

log = logging.getLogger(__name__)
SEED = 1234  # the harness's own default seed for few-shot sampling (unused at 0-shot, set for determinism)
_STDERR = "_stderr"
_NO_POOL = "DISABLE_MULTIPROC"  # the harness's switch for its bootstrap pool (lm_eval/api/metrics.py)
# modules whose `tqdm` the harness calls; "tqdm" itself for its bootstrap's `from tqdm import tqdm` at call time
_HARNESS_BARS = ("tqdm", "lm_eval.api.task", "lm_eval.api.model", "lm_eval.models.huggingface")
# messages the harness logs for every model object passed in; they concern launchers we do not use
_NOISE = ("`pretrained` model kwarg is not of type `str`", "Passed an already-initialized model through `pretrained`")


def evaluate_runners(tasks: LoadedTasks, cfg: FidelityConfig, tokenizer, dense_model, runners: dict[str, Any]) -> dict[str, Any]:
    """Score the dense model and each PyTorch runner's model; other runtimes are skipped and listed."""
    from laco_deploy.runtimes.runner import TorchRunner

    models = {"dense": dense_model}
    skipped: dict[str, str] = {}
    for label, runner in runners.items():
        if isinstance(runner, TorchRunner):
            models[label] = runner.model
        else:
            skipped[label] = f"{runner.name} candidate: lm-evaluation-harness runs the PyTorch models only"
            log.info("zero-shot: skipping %s (%s runtime): lm-evaluation-harness scores PyTorch models only", label, runner.name)
    return evaluate_models(tasks, cfg, tokenizer, models, skipped)


def evaluate_models(tasks: LoadedTasks, cfg: FidelityConfig, tokenizer, models: dict[str, Any],
                    skipped: dict[str, str] | None = None) -> dict[str, Any]:
    """Every task on every model (label -> transformers causal LM on its device in eval mode, or a
    function returning one: then each model is loaded when its turn comes and released after, so
    only one is in memory)."""
    per_model: dict[str, dict[str, Any]] = {}
    for label in list(models):
        t0 = time.perf_counter()
        model = models[label]
        if callable(model) and not isinstance(model, torch.nn.Module):
            model = model()
        log.info("zero-shot: %s on %d task(s)", label, len(tasks.task_dict["tasks"]))
        scores = _evaluate_one(tasks, cfg, tokenizer, model)
        del model
        gc.collect()
        trim_heap()  # the next model loads into the pages this one freed, not next to them
        per_model[label] = {"tasks": scores, "mean": mean_over_tasks(scores), "wall_s": time.perf_counter() - t0}
    return {
        "tasks": tasks.describe(),
        "models": per_model,
        "skipped": dict(skipped or {}),
        "settings": {"num_fewshot": 0, "limit": cfg.task_limit, "batch_size": _batch_size(cfg),
                     "specs": list(cfg.tasks), "tokenizer": "the dense model's, for every model"},
        "versions": {"lm_eval": importlib.metadata.version("lm_eval")},
    }


def _evaluate_one(tasks: LoadedTasks, cfg: FidelityConfig, tokenizer, model) -> dict[str, dict[str, Any]]:
    from lm_eval.evaluator import evaluate

    from laco_deploy.fidelity.harness_lm import ContinuationLM

    with _quiet_harness():
        # add_bos_token left unset: contexts are encoded with the tokenizer's own special tokens (BOS where
        # it adds one), as data.py's samples are; the LM head runs at the continuations' positions only
        lm = ContinuationLM(pretrained=model, tokenizer=tokenizer, batch_size=_batch_size(cfg))
        for task in tasks.task_dict["tasks"].values():
            task.set_config(key="num_fewshot", value=0)
            task.set_fewshot_seed(seed=SEED)
        out = evaluate(lm=lm, task_dict=tasks.task_dict, limit=cfg.task_limit, bootstrap_iters=1000, log_samples=False)
    return {name: _task_scores(out["results"][name], out["n-samples"].get(name, {})) for name in tasks.task_dict["tasks"]}


def _batch_size(cfg: FidelityConfig) -> int:
    """fidelity.task_batch_size, or where unset 1: one sequence per call, its head on the continuation
    only (sizing.zeroshot_batch)."""
    return zeroshot_batch(cfg.task_batch_size)


def _task_scores(results: dict[str, Any], n_samples: dict[str, int]) -> dict[str, Any]:
    """The harness's "metric,filter" keys -> {metrics: {metric: {value, stderr}}, n}; the "none" filter
    (multiple-choice tasks) is named by its metric alone, any other filter as metric/filter."""
    metrics: dict[str, dict[str, float | None]] = {}
    for key, value in results.items():
        if "," not in key or not isinstance(value, (int, float)):
            continue
        metric, flt = key.split(",", 1)
        if metric.endswith(_STDERR):
            continue
        stderr = results.get(f"{metric}{_STDERR},{flt}")
        name = metric if flt == "none" else f"{metric}/{flt}"
        metrics[name] = {"value": float(value), "stderr": float(stderr) if isinstance(stderr, (int, float)) else None}
    return {"metrics": metrics, "n": int(n_samples.get("effective", results.get("sample_len", 0)))}


def mean_over_tasks(scores: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per metric: the unweighted mean over the tasks that report it, the standard error of that mean
    (sqrt(sum se^2) / k, tasks independent; None when a task has no stderr) and the task count k."""
    by_metric: dict[str, list[dict[str, float | None]]] = {}
    for s in scores.values():
        for metric, m in s["metrics"].items():
            by_metric.setdefault(metric, []).append(m)
    out = {}
    for metric, ms in by_metric.items():
        k = len(ms)
        se = None if any(m["stderr"] is None for m in ms) else math.sqrt(sum(m["stderr"] ** 2 for m in ms)) / k
        out[metric] = {"value": sum(m["value"] for m in ms) / k, "stderr": se, "tasks": k}
    return out


def accuracy_over_tasks(scores: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """The papers' headline: per task acc_norm where the task defines it, else acc, averaged over every
    task that reports either, with the standard error of that mean as in mean_over_tasks; None when no
    task reports an accuracy. {"value", "stderr", "tasks", "metrics": {task: metric used}}"""
    used = {task: ("acc_norm" if "acc_norm" in s["metrics"] else "acc") for task, s in scores.items()
            if {"acc", "acc_norm"} & set(s["metrics"])}
    if not used:
        return None
    mean = mean_over_tasks({task: {"metrics": {"accuracy": scores[task]["metrics"][metric]}} for task, metric in used.items()})
    return {**mean["accuracy"], "metrics": used}


@contextlib.contextmanager
def _quiet_harness():
    """The harness logs at INFO per task and warns per model object about launchers we do not use:
    keep its warnings (e.g. truncated contexts) and drop the rest unless laco-deploy logs at DEBUG.
    Its progress bars are switched off (our log line names each model as it starts), what it prints
    goes to the debug log (stdout holds our results), and its bootstrap standard errors (perplexity)
    run in this process: its pool of forked workers, ended with SIGTERM, ran the CLI's handler in the
    children and could hang the run."""
    harness = logging.getLogger("lm_eval")
    before = harness.level
    if not log.isEnabledFor(logging.DEBUG):
        harness.setLevel(logging.WARNING)
    noise = _DropMessages(_NOISE)
    hf_logger = logging.getLogger("lm_eval.models.huggingface")
    hf_logger.addFilter(noise)
    multiproc = os.environ.get(_NO_POOL)
    os.environ[_NO_POOL] = "1"
    try:
        with contextlib.ExitStack() as stack:
            for module in _HARNESS_BARS:
                stack.enter_context(_bars_off(module))
            printed = stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
            yield
        if printed.getvalue().strip():
            log.debug("lm-evaluation-harness printed: %s", printed.getvalue().strip())
    finally:
        if multiproc is None:
            os.environ.pop(_NO_POOL, None)
        else:
            os.environ[_NO_POOL] = multiproc
        hf_logger.removeFilter(noise)
        harness.setLevel(before)


@contextlib.contextmanager
def _bars_off(module_name: str):
    """The module-level `tqdm` of one harness module, with every bar it makes disabled."""
    module = importlib.import_module(module_name)
    original = getattr(module, "tqdm", None)
    if original is None:  # another harness version, laid out differently
        yield
        return

    def silent(*args, **kwargs):
        kwargs["disable"] = True
        return original(*args, **kwargs)

    module.tqdm = silent
    try:
        yield
    finally:
        module.tqdm = original


class _DropMessages(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


# ---- report tables ----------------------------------------------------------------------------


def table(zs: dict[str, Any]) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    """(header, rows) of the accuracy table: one row per task and metric, then the means over tasks;
    cells are "value ± stderr" in percent for every model (dense first)."""
    labels = list(zs["models"])
    head = ("task", "metric", "n") + tuple(labels)
    rows: list[tuple[str, ...]] = []
    for task, info in zs["tasks"].items():
        first = zs["models"][labels[0]]["tasks"][task]
        for metric in first["metrics"]:
            cells = tuple(_cell(zs["models"][lab]["tasks"][task]["metrics"].get(metric), metric) for lab in labels)
            rows.append((task, metric, str(first["n"])) + cells)
    means = zs["models"][labels[0]]["mean"] if len(zs["tasks"]) > 1 else {}  # one task: its row says it all
    for metric, m in means.items():
        name = f"mean over {m['tasks']} task{'s' if m['tasks'] != 1 else ''}"
        rows.append((name, metric, "") + tuple(_cell(zs["models"][lab]["mean"].get(metric), metric) for lab in labels))
    return head, rows


def _cell(m: dict[str, Any] | None, metric: str = "acc") -> str:
    """Accuracies in percent; perplexities (laco_lastword's target words) as they are."""
    if m is None or m["value"] is None:
        return "-"
    scale = 1 if "perplexity" in metric else 100
    se = m.get("stderr")
    return f"{scale * m['value']:.1f}" + (f" ± {scale * se:.1f}" if se is not None and math.isfinite(se) else "")


def notes(zs: dict[str, Any]) -> list[str]:
    """What the table was measured on: splits, sizes and sources; skipped candidates; the limit."""
    out = []
    for task, info in zs["tasks"].items():
        src = f"data {', '.join(info['data_files'])}" if info["data_files"] else f"harness task {info['source']}"
        out.append(f"{task}: {info['split']} split, {info['docs']} documents ({info['kind']}; {src})")
    if zs["settings"].get("limit"):
        out.append(f"only the first {zs['settings']['limit']} documents of each task were scored (fidelity.task_limit)")
    walls = {label: m.get("wall_s") for label, m in zs["models"].items() if m.get("wall_s") is not None}
    if walls:  # what the row costs, so a user can weigh it (build --no-tasks drops it)
        out.append(f"scored in {sum(walls.values()):.0f} s: " + ", ".join(f"{k} {v:.0f} s" for k, v in walls.items()))
    out += [f"not scored: {label} ({why})" for label, why in zs.get("skipped", {}).items()]
    return out
