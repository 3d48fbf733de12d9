"""One benchmark harness for every runtime, so that all are measured the same way by construction.

Each model is measured in a fresh Python process (`python -m <adapter module> JOB.json`): it gets
its own peak RSS, and no model's pages or caches help the next. The harness owns what is measured
and how: load time, warm-up, prompt processing and generation timing, time to first token, peak
RSS, perplexity (llama-perplexity protocol), statistics, the protocol text and the CPU facts. A
runtime adapter (bench/llamacpp_bench.py, bench/onnxrt_bench.py) only loads a model and exposes
prefill / one decode step / window logits / metadata as a `Session`, and prepares its job.

The child imports numpy, this module and its runtime only (never torch), so its memory is the
runtime's.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Protocol

import numpy as np

from laco_deploy.artifacts import BenchResult
from laco_deploy.config import BenchConfig, to_dict
from laco_deploy.errors import ConfigError, RuntimeBackendError
from laco_deploy.runtimes.cpu import cpu_name, physical_cores

LACO_PREFIX = "laco_deploy."  # metadata keys written by our exporters (GGUF keys, ONNX metadata_props)


# ---- CPU and process facts ---------------------------------------------------------------------


def rss_mib(field: str) -> float:
    """A memory field of this process from /proc/self/status ("VmRSS", "VmHWM") in MiB; NaN if unknown."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def stat(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "spread": (max(values) - min(values)) / 2}


# ---- tokens and perplexity ---------------------------------------------------------------------


def plan_tokens(ids: list[int], bos_id: int | None, cfg: BenchConfig) -> dict[str, list]:
    """Token ids of the evaluation text (with BOS first when the model adds one: bos_id) -> the
    perplexity windows (`ppl_ctx` tokens each, first token replaced by BOS when the model adds one)
    and the `n_prompt`-token prompt for the speed runs (text repeated when it is short)."""
    n = min(cfg.ppl_windows, len(ids) // cfg.ppl_ctx)
    if n < 1:
        raise ConfigError(f"evaluation text has {len(ids)} tokens, fewer than one window of {cfg.ppl_ctx}; lower bench.ppl_ctx or add text")
    windows = [list(ids[i * cfg.ppl_ctx:(i + 1) * cfg.ppl_ctx]) for i in range(n)]
    if bos_id is not None:
        for window in windows:
            window[0] = bos_id
    body = list(ids[1:] if bos_id is not None else ids)
    prompt = (body * (cfg.n_prompt // max(1, len(body)) + 1))[: cfg.n_prompt]
    return {"windows": windows, "prompt": prompt}


NLL_ROWS = 32  # logits rows turned into float64 at a time (a whole 512 x 49,152 window: 3 x 96 MiB)


def window_nll(logits: np.ndarray, tokens: list[int], first: int) -> np.ndarray:
    """Negative log-likelihoods of tokens[first+1:] given logits [n_ctx, vocab] of a window:
    position j predicts token j+1, for j in first..n_ctx-2 (llama-perplexity). [n_ctx-1-first] float64.
    Computed NLL_ROWS rows at a time: every row's numbers are those of the whole window at once."""
    target = np.asarray(tokens[first + 1 :])
    nll = np.empty(len(target), dtype=np.float64)
    for start in range(0, len(target), NLL_ROWS):
        rows = logits[first + start : first + min(start + NLL_ROWS, len(target))].astype(np.float64)
        rows -= rows.max(axis=1, keepdims=True)
        logz = np.log(np.exp(rows).sum(axis=1))
        nll[start : start + len(rows)] = logz - rows[np.arange(len(rows)), target[start : start + len(rows)]]
    return nll


def perplexity(window_logits: Callable[[list[int]], np.ndarray], windows: list[list[int]]) -> dict[str, Any]:
    """Each window evaluated from an empty cache; its second half scored (early tokens lack context)."""
    nll = [window_nll(window_logits(window), window, len(window) // 2) for window in windows]
    all_nll = np.concatenate(nll)
    return {"ppl": float(math.exp(all_nll.mean())), "ppl_tokens": int(all_nll.size), "ppl_windows": len(windows)}


# ---- inside the child process ------------------------------------------------------------------


class Session(Protocol):
    """One model loaded in a runtime, inside the child process."""

    def prefill(self, ids: list[int]) -> np.ndarray:
        """Evaluate `ids` from an empty cache -> logits after the last token [vocab]."""

    def step(self, token: int) -> np.ndarray:
        """Evaluate one more token with the cache -> its logits [vocab]."""

    def window_logits(self, ids: list[int]) -> np.ndarray:
        """Logits of every position of `ids` from an empty cache [len(ids), vocab] (perplexity)."""

    def metadata(self) -> dict[str, str]:
        """The model file's metadata (laco_deploy.* keys among them)."""

    def facts(self) -> dict[str, Any]:
        """Runtime-specific fields of the result (provider, file type, ...)."""

    def close(self) -> None: ...


class Adapter(Protocol):
    def load(self, job: dict[str, Any]) -> Session: ...

    def tokens(self, session: Session, job: dict[str, Any], cfg: BenchConfig) -> dict[str, list]:
        """The plan_tokens() result for this model (tokenized here or by the parent)."""


def speed(session: Session, prompt: list[int], n_gen: int) -> tuple[float, float, float]:
    """(pp tok/s, TTFT s, tg tok/s): the prompt in one batch from an empty cache, first token by
    argmax; then n_gen greedy single-token steps after a 1-token prompt (llama-bench's tg)."""
    t0 = time.perf_counter()
    logits = session.prefill(prompt)
    t_pp = time.perf_counter() - t0
    token = int(np.argmax(logits))
    ttft = time.perf_counter() - t0
    logits = session.prefill([token])
    t0 = time.perf_counter()
    for _ in range(n_gen):
        token = int(np.argmax(logits))
        logits = session.step(token)
    t_tg = time.perf_counter() - t0
    return len(prompt) / t_pp, ttft, n_gen / t_tg


def measure(adapter: Adapter, job: dict[str, Any]) -> dict[str, Any]:
    """Every metric for one model (call in a fresh process for a meaningful peak RSS)."""
    cfg = BenchConfig(**job["cfg"])
    base_rss = rss_mib("VmRSS")
    loads, session = [], None
    for _ in range(cfg.repetitions):
        if session is not None:
            session.close()  # free the previous model before timing the next load
        t0 = time.perf_counter()
        session = adapter.load(job)
        loads.append(time.perf_counter() - t0)
    plan = adapter.tokens(session, job, cfg)
    speed(session, plan["prompt"][:16], 4)  # warm-up, as llama-bench does
    runs = [speed(session, plan["prompt"], cfg.n_gen) for _ in range(cfg.repetitions)]
    peak_rss = rss_mib("VmHWM")  # load and speed runs: what serving the model takes
    laco = {k[len(LACO_PREFIX):]: v for k, v in session.metadata().items() if k.startswith(LACO_PREFIX)}
    facts = session.facts()
    ppl = perplexity(session.window_logits, plan["windows"])
    session.close()
    return {
        **ppl,
        "pp_tps": stat([r[0] for r in runs]),
        "tg_tps": stat([r[2] for r in runs]),
        "ttft_s": stat([r[1] for r in runs]),
        "load_s": stat(loads),
        "peak_rss_mib": peak_rss,
        "base_rss_mib": base_rss,
        **facts,
        "pattern": laco.get("pattern"),
        "laco_deploy": laco,
    }


def child_main(adapter: Adapter) -> None:
    """Entry of an adapter module run as `python -m MODULE JOB.json`: measure, write JSON."""
    from laco_deploy.fsutil import write_json

    job = json.loads(Path(sys.argv[1]).read_text())
    write_json(Path(job["out"]), measure(adapter, job))


# ---- in the parent -----------------------------------------------------------------------------


def eval_text(eval_spec: str) -> str:
    """The evaluation documents joined by blank lines (as the file llama-perplexity would read)."""
    from laco_deploy.data import load_texts

    return "\n\n".join(load_texts(eval_spec, "eval"))


def run_child(module: str, label: str, path: Path, job: dict[str, Any]) -> dict[str, Any]:
    """Measure one model in `python -m module JOB.json`; -> its metrics."""
    with tempfile.TemporaryDirectory(prefix="laco-bench-") as work:
        job_file, out = Path(work) / "job.json", Path(work) / "result.json"
        job_file.write_text(json.dumps({**job, "path": str(Path(path).resolve()), "out": str(out)}))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        proc = subprocess.run([sys.executable, "-m", module, str(job_file)], env=env,
                              capture_output=True, text=True, check=False)
        if proc.returncode != 0 or not out.is_file():
            tail = (proc.stderr or "").strip().splitlines()[-1:] or ["no output"]
            raise RuntimeBackendError(f"benchmarking {label} ({path}) failed: {tail[0]}")
        return json.loads(out.read_text())


def measure_all(runtime: str, module: str, models: dict[str, Path], cfg: BenchConfig,
                job_for: Callable[[Path], dict[str, Any]], size_bytes: Callable[[Path], int]) -> dict[str, dict[str, Any]]:
    """Each model in its own child process, in order; speed ratios against the first."""
    from laco_deploy.progress import progress_bar

    results: dict[str, dict[str, Any]] = {}
    for label, path in progress_bar(list(models.items()), desc=f"{runtime} bench", unit="model"):
        job = {**job_for(Path(path)), "cfg": to_dict(cfg)}
        results[label] = {**run_child(module, label, Path(path), job), "size_mib": size_bytes(Path(path)) / 2**20}
    ref = next(iter(results.values()))
    for metrics in results.values():
        metrics["tg_speedup"] = metrics["tg_tps"]["median"] / ref["tg_tps"]["median"]
        metrics["pp_speedup"] = metrics["pp_tps"]["median"] / ref["pp_tps"]["median"]
    return results


def check_config(cfg: BenchConfig) -> None:
    errs = cfg.validate()
    if errs:
        raise ConfigError("; ".join(errs))


def protocol(cfg: BenchConfig, eval_spec: str, *, tokenizer: str, cache: str, load: str, size: str) -> dict[str, Any]:
    """How every number was measured; the runtime supplies its words for tokenizer, cache, load, size."""
    half = cfg.ppl_ctx // 2
    return {
        "perplexity": (f"llama-perplexity: the {eval_spec} evaluation text (documents joined by blank lines) is "
                       f"tokenized by each model's own tokenizer ({tokenizer}); up to {cfg.ppl_windows} consecutive "
                       f"windows of {cfg.ppl_ctx} tokens, the first token of each replaced by BOS when the model adds "
                       f"one; each window evaluated from an empty cache; logits at positions {half}..{cfg.ppl_ctx - 2} "
                       f"score the next token ({cfg.ppl_ctx - 1 - half} per window); ppl = exp(mean NLL)"),
        "prompt": f"pp: {cfg.n_prompt} tokens of evaluation text evaluated in one batch from an empty cache; tok/s = n / time",
        "generation": (f"tg: {cfg.n_gen} greedy tokens one at a time ({cache}) after a 1-token prompt (as llama-bench tg), "
                       "argmax included"),
        "ttft": f"time from submitting the {cfg.n_prompt}-token prompt to having the first generated token",
        "load": load,
        "rss": ("peak resident set (VmHWM) of a fresh process per model (numpy and the runtime, no torch) after load "
                "and speed runs; base_rss_mib is that process before loading"),
        "size": size,
        "repetitions": cfg.repetitions,
        "spread": "(max - min) / 2 over the repetitions; value shown is the median",
    }


def environment(threads: int, device: str, **runtime_facts: Any) -> dict[str, Any]:
    return {"threads": threads, "device": device, **runtime_facts, "cpu": cpu_name(),
            "physical_cores": physical_cores(), "load_avg_1m": round(os.getloadavg()[0], 2)}


def sparsity_notes(results: dict[str, dict[str, Any]], runtime: str) -> list[str]:
    """Unstructured / N:M models do the same work as dense ones on dense kernels: say so per row."""
    return [f"{label}: {m['pattern']} sparsity: same tensor shapes and types as a dense model, so {runtime} does the "
            "same work; a speed difference from a dense row of the same type is measurement noise"
            for label, m in results.items() if m.get("pattern") and m["pattern"] != "structured"]


def bench_result(runtime: str, cfg: BenchConfig, eval_spec: str, results: dict[str, dict[str, Any]], *,
                 environment: dict[str, Any], notes: list[str], words: dict[str, str]) -> BenchResult:
    return BenchResult(runtime=runtime, environment=environment, protocol=protocol(cfg, eval_spec, **words),
                       models=results, notes=notes + sparsity_notes(results, runtime))
