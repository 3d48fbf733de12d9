"""The onnxruntime benchmark: each export measured in a fresh Python process.

The parent tokenizes the evaluation text with each export's own tokenizer and writes a job
file; the child (`python -m laco_deploy.bench.onnxrt_worker JOB.json`) imports only numpy and
onnxruntime, so its peak RSS is the runtime's, and no model's caches help the next. The
protocol matches laco_deploy.bench.llamacpp (llama-perplexity windows, llama-bench pp/tg).
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
from typing import Any

import numpy as np

from laco_deploy.bench.onnxrt import (
    OrtDecoder,
    model_file,
    physical_cores,
    providers_for,
    second_half_nll,
)
from laco_deploy.errors import ConfigError, RuntimeBackendError

NO_SPEEDUP_NOTE = ("unstructured and N:M sparsity give no speed-up on onnxruntime: its kernels are dense and sparse "
                   "storage is densified at load; only structured pruning (smaller matrices) or int8 makes it faster")


# ---- inside the child process -----------------------------------------------------------------


def _rss_mib(field: str) -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def _stat(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "spread": (max(values) - min(values)) / 2}


def perplexity(decoder: OrtDecoder, windows: list[list[int]]) -> dict[str, Any]:
    """Windows [n, ctx] each prefilled from an empty past; second half of each scored."""
    total, count = 0.0, 0
    for window in windows:
        ids = np.asarray(window, dtype=np.int64)
        logits, _ = decoder.prefill(ids)
        nll, n = second_half_nll(logits, ids)
        total, count = total + nll, count + n
    return {"ppl": math.exp(total / count), "ppl_tokens": count, "ppl_windows": len(windows)}


def _speed(decoder: OrtDecoder, prompt: np.ndarray, n_gen: int) -> tuple[float, float, float]:
    """(pp tok/s, TTFT s, tg tok/s): the prompt in one prefill from an empty past, first token by
    argmax; then n_gen greedy single-token steps with KV cache after a 1-token prompt."""
    t0 = time.perf_counter()
    logits, _ = decoder.prefill(prompt)
    t_pp = time.perf_counter() - t0
    token = int(np.argmax(logits[-1]))
    ttft = time.perf_counter() - t0
    logits, past = decoder.prefill(np.array([token], dtype=np.int64))
    token = int(np.argmax(logits[-1]))
    t0 = time.perf_counter()
    for pos in range(1, n_gen + 1):
        step_logits, past = decoder.step(token, pos, past)
        token = int(np.argmax(step_logits))
    t_tg = time.perf_counter() - t0
    return prompt.shape[0] / t_pp, ttft, n_gen / t_tg


def measure_model(job: dict[str, Any]) -> dict[str, Any]:
    """Every metric for one export (call in a fresh process for a meaningful peak RSS)."""
    base_rss = _rss_mib("VmRSS")
    loads, decoder = [], None
    for _ in range(job["repetitions"]):
        decoder = None  # drop the previous session before timing the next load
        t0 = time.perf_counter()
        decoder = OrtDecoder(Path(job["path"]), device=job["device"], threads=job["threads"])
        loads.append(time.perf_counter() - t0)
    prompt = np.asarray(job["prompt"], dtype=np.int64)
    _speed(decoder, prompt[:16], 4)  # warm-up
    runs = [_speed(decoder, prompt, job["n_gen"]) for _ in range(job["repetitions"])]
    ppl = perplexity(decoder, job["windows"])
    meta = decoder.session.get_modelmeta().custom_metadata_map
    laco = {k[len("laco_deploy."):]: v for k, v in meta.items() if k.startswith("laco_deploy.")}
    return {
        **ppl,
        "pp_tps": _stat([r[0] for r in runs]),
        "tg_tps": _stat([r[2] for r in runs]),
        "ttft_s": _stat([r[1] for r in runs]),
        "load_s": _stat(loads),
        "peak_rss_mib": _rss_mib("VmHWM"),
        "base_rss_mib": base_rss,
        "provider": decoder.provider,
        "threads": decoder.threads,
        "kv_dtype": np.dtype(decoder.kv_dtype).name,
        "quant": laco.get("quant"),
        "pattern": laco.get("pattern"),
        "laco_deploy": laco,
    }


def _worker(job_file: str) -> None:
    from laco_deploy.fsutil import write_json

    job = json.loads(Path(job_file).read_text())
    write_json(Path(job["out"]), measure_model(job))


# ---- in the parent --------------------------------------------------------------------------------


def export_bytes(path: Path) -> int:
    """Bytes of an export's graph and weight files (folder) or of an .onnx file and its data."""
    from exporters.onnx_sparse import DENSE_FILE, SPARSE_FILE

    f = model_file(path)
    names = [f.name, f.name + "_data", f.name + ".data", SPARSE_FILE, DENSE_FILE]
    return sum((f.parent / n).stat().st_size for n in dict.fromkeys(names) if (f.parent / n).is_file())


def eval_tokens(path: Path, eval_spec: str, cfg) -> dict[str, Any]:
    """Tokenize the evaluation text with the export's tokenizer -> ppl windows and the prompt."""
    from transformers import AutoTokenizer

    from laco_deploy.data import load_texts

    folder = model_file(path).parent
    try:
        tok = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as e:
        raise RuntimeBackendError(f"no tokenizer next to {model_file(path)} ({e}); benchmark an export folder written by laco-deploy export --target onnx") from e
    ids = tok("\n\n".join(load_texts(eval_spec, "eval")))["input_ids"]
    bos = tok.bos_token_id
    add_bos = bos is not None and len(ids) > 0 and ids[0] == bos
    body = ids[1:] if add_bos else ids
    n = min(cfg.ppl_windows, len(ids) // cfg.ppl_ctx)
    if n < 1:
        raise ConfigError(f"evaluation text has {len(ids)} tokens, fewer than one window of {cfg.ppl_ctx}; lower --ppl-ctx or add text")
    windows = [list(ids[i * cfg.ppl_ctx:(i + 1) * cfg.ppl_ctx]) for i in range(n)]
    if add_bos:
        for w in windows:
            w[0] = bos
    prompt = (body * (cfg.n_prompt // max(1, len(body)) + 1))[: cfg.n_prompt]
    return {"windows": windows, "prompt": prompt}


def _run_one(label: str, path: Path, job: dict[str, Any]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="laco-ort-") as work:
        job_file, out = Path(work) / "job.json", Path(work) / "result.json"
        job_file.write_text(json.dumps({**job, "path": str(Path(path).resolve()), "out": str(out)}))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        proc = subprocess.run([sys.executable, "-m", "laco_deploy.bench.onnxrt_worker", str(job_file)], env=env,
                              capture_output=True, text=True, check=False)
        if proc.returncode != 0 or not out.is_file():
            tail = (proc.stderr or "").strip().splitlines()[-1:] or ["no output"]
            raise RuntimeBackendError(f"benchmarking {label} ({path}) failed: {tail[0]}")
        return json.loads(out.read_text())


def run_all(models: dict[str, Path], *, eval_spec: str, cfg, device: str = "cpu"):
    """Benchmark ONNX exports side by side; the first is the reference for speed ratios."""
    import onnxruntime as ort
    from laco_deploy.progress import progress_bar

    from laco_deploy.artifacts import BenchResult

    errs = cfg.validate()
    if errs:
        raise ConfigError("; ".join(errs))
    for path in models.values():
        model_file(Path(path))
    providers_for(device)  # a missing CUDA provider fails here, before any work
    threads = cfg.threads or physical_cores()
    results: dict[str, dict[str, Any]] = {}
    for label, path in progress_bar(list(models.items()), desc="onnxruntime bench", unit="model"):
        job = {"device": device, "threads": threads, "repetitions": cfg.repetitions, "n_gen": cfg.n_gen,
               **eval_tokens(Path(path), eval_spec, cfg)}
        results[label] = {**_run_one(label, Path(path), job), "size_mib": export_bytes(Path(path)) / 2**20}
    ref = next(iter(results.values()))
    for metrics in results.values():
        metrics["tg_speedup"] = metrics["tg_tps"]["median"] / ref["tg_tps"]["median"]
        metrics["pp_speedup"] = metrics["pp_tps"]["median"] / ref["pp_tps"]["median"]
    notes = [NO_SPEEDUP_NOTE]
    for label, m in results.items():
        if m.get("pattern") and not str(m["pattern"]).startswith("structured"):
            notes.append(f"{label}: {m['pattern']} sparsity; its speed equals a dense model of the same type on onnxruntime")
    environment = {"provider": next(iter(results.values()))["provider"], "threads": threads, "device": device,
                   "onnxruntime": ort.__version__, "cpu": _cpu_name(), "physical_cores": physical_cores()}
    return BenchResult(runtime="onnxruntime", environment=environment, protocol=_protocol(cfg, eval_spec),
                       models=results, notes=notes)


def _protocol(cfg, eval_spec: str) -> dict[str, Any]:
    half = cfg.ppl_ctx // 2
    return {
        "perplexity": (f"llama-perplexity windows: the {eval_spec} evaluation text (documents joined by blank lines) "
                       f"tokenized by each export's own tokenizer; up to {cfg.ppl_windows} consecutive windows of "
                       f"{cfg.ppl_ctx} tokens, first token replaced by BOS when the tokenizer adds one; each window "
                       f"prefilled from an empty past; logits at positions {half}..{cfg.ppl_ctx - 2} score the next "
                       f"token ({cfg.ppl_ctx - 1 - half} per window); ppl = exp(mean NLL)"),
        "prompt": f"pp: {cfg.n_prompt} tokens of evaluation text in one prefill from an empty past; tok/s = n / time",
        "generation": (f"tg: {cfg.n_gen} greedy tokens one at a time with the KV cache kept in onnxruntime (IO binding) "
                       "after a 1-token prompt (as llama-bench tg), argmax included"),
        "ttft": f"time from submitting the {cfg.n_prompt}-token prompt to having the first generated token",
        "load": "InferenceSession construction with full graph optimisation (sparse storage: densify included)",
        "rss": ("peak resident set (VmHWM) of a fresh process per model (numpy + onnxruntime only) after load, speed "
                "and perplexity runs; base_rss_mib is that process before loading"),
        "size": "graph and weight files of the export (tokenizer and configs not counted)",
        "repetitions": cfg.repetitions,
        "spread": "(max - min) / 2 over the repetitions; value shown is the median",
    }


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    _worker(sys.argv[1])
