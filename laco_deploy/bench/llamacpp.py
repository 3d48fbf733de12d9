"""llama.cpp (llama-cpp-python) as a CausalRunner, and the llama.cpp benchmark.

`LlamaCppRunner(path).logits(ids)` gives next-token logits from a GGUF file (fidelity and the
export parity check use it). `run_benchmark` measures each model in a fresh Python process
(`python -m laco_deploy.bench.llamacpp JOB.json`), so that each gets its own peak RSS and no
model's pages or caches help the next: perplexity with llama-perplexity's protocol, prompt
processing and generation speed, time to first token, load time, file size and peak RSS.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any

import numpy as np

from laco_deploy.artifacts import BenchResult
from laco_deploy.bench.llamacpp_probe import EXTRA_BUFFERS_NOTE, extra_buffers_work, model_params
from laco_deploy.config import BenchConfig, to_dict
from laco_deploy.errors import ConfigError, RuntimeBackendError

log = logging.getLogger(__name__)

RUNNER_N_CTX = 512  # context of a logits runner; sequences longer than this are refused
NO_SPEEDUP_NOTE = ("unstructured and N:M sparsity give no speed-up on llama.cpp: it stores the zeros densely and "
                   "multiplies them like any other weight; only structured pruning (smaller matrices) or a smaller "
                   "weight type makes it faster")


def physical_cores() -> int:
    """Physical CPU cores (what llama.cpp uses by default), from /proc/cpuinfo; else os.cpu_count()."""
    try:
        pairs, phys, core = set(), None, None
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "physical id":
                phys = value.strip()
            elif key == "core id":
                core = value.strip()
            elif not key and phys is not None and core is not None:
                pairs.add((phys, core))
                phys = core = None
        if phys is not None and core is not None:
            pairs.add((phys, core))
        if pairs:
            return len(pairs)
    except OSError:
        pass
    return os.cpu_count() or 1


_LIVE: "weakref.WeakSet[LlamaCppRunner]" = weakref.WeakSet()


@atexit.register
def _close_live_runners() -> None:
    """Free llama.cpp models before interpreter teardown (llama-cpp-python's __del__ fails late)."""
    for runner in list(_LIVE):
        runner.close()


def _check_gguf_file(path: Path) -> None:
    if not path.is_file():
        raise RuntimeBackendError(f"GGUF file {path} not found; export one with `laco-deploy export --target gguf`")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise RuntimeBackendError(f"{path} is not a GGUF file (magic {magic!r}); re-export it with `laco-deploy export --target gguf`")


class LlamaCppRunner:
    """A GGUF model in llama.cpp. logits: input_ids [seq] int64 -> [seq, vocab] float32 (CPU)."""

    name = "llama.cpp"

    def __init__(self, path: Path, threads: int | None = None, n_ctx: int = RUNNER_N_CTX, *,
                 logits_all: bool = True, n_gpu_layers: int = 0, extra_buffers: bool | None = None):
        """extra_buffers: use llama.cpp's AMX/repack CPU kernels; None probes once whether they work here."""
        self.path = Path(path)
        _check_gguf_file(self.path)
        try:
            import llama_cpp
        except ImportError as e:
            raise RuntimeBackendError("llama.cpp needs llama-cpp-python: pip install llama-cpp-python") from e
        self.threads = threads or physical_cores()
        self.n_ctx = n_ctx
        self.extra_buffers = extra_buffers_work() if extra_buffers is None else extra_buffers
        try:
            with model_params(use_extra_bufts=self.extra_buffers):
                self.llm = llama_cpp.Llama(model_path=str(self.path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx,
                                           n_threads=self.threads, n_threads_batch=self.threads,
                                           logits_all=logits_all, n_gpu_layers=n_gpu_layers, verbose=False)
        except (ValueError, RuntimeError, OSError) as e:
            raise RuntimeBackendError(f"llama.cpp cannot load {self.path} ({e}); the file is corrupt, truncated or made "
                                      "for a newer llama.cpp: re-export it or upgrade llama-cpp-python") from e
        _LIVE.add(self)
        self.n_vocab = self.llm.n_vocab()
        self.add_bos = bool(self.llm._model.add_bos_token())
        self.bos_id = int(self.llm.token_bos())

    def _eval(self, ids: list[int]) -> None:
        if len(ids) > self.n_ctx:
            raise ConfigError(f"sequence of {len(ids)} tokens exceeds the llama.cpp context of {self.n_ctx}; "
                              f"use shorter windows or LlamaCppRunner(..., n_ctx={len(ids)})")
        bad = [i for i in ids if not 0 <= i < self.n_vocab]
        if bad:
            raise ConfigError(f"token id {bad[0]} is outside the vocabulary of {self.path.name} ({self.n_vocab}); "
                              "tokenize with this model's tokenizer")
        self.llm.reset()
        self.llm.eval(ids)

    def logits(self, input_ids):
        """input_ids: torch.Tensor [seq] int64 -> torch.Tensor [seq, vocab] float32."""
        import torch

        return torch.from_numpy(self.logits_np([int(i) for i in input_ids.reshape(-1).tolist()]))

    def logits_np(self, ids: list[int]) -> np.ndarray:
        """The same without torch (the benchmark worker does not import it). [seq, vocab] float32."""
        if not self.llm._logits_all:
            raise ConfigError("this LlamaCppRunner was built with logits_all=False; build it with logits_all=True")
        self._eval(ids)
        return np.array(self.llm.scores[: len(ids)], dtype=np.float32, copy=True)

    def last_logits(self) -> np.ndarray:
        """Logits after the last evaluated token. [vocab] float32 (a view into llama.cpp's buffer)."""
        return np.ctypeslib.as_array(self.llm._ctx.get_logits_ith(-1), shape=(self.n_vocab,))

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """llama.cpp's own tokenizer; BOS/EOS added exactly when the model says so (add_special);
        parse_special: turn special-token text such as <|im_start|> into its id (as HF does)."""
        return list(self.llm.tokenize(text.encode("utf-8"), add_bos=add_special, special=parse_special))

    def metadata(self) -> dict[str, str]:
        return dict(self.llm.metadata)

    def close(self) -> None:
        """Free the model and context (idempotent)."""
        self.llm.close()
        _LIVE.discard(self)


# ---- perplexity (llama-perplexity protocol) ----------------------------------------------------


def window_nll(logits: np.ndarray, tokens: list[int], first: int) -> np.ndarray:
    """Negative log-likelihoods of tokens[first+1:] given logits [n_ctx, vocab] of a window:
    position j predicts token j+1, for j in first..n_ctx-2 (llama-perplexity). [n_ctx-1-first] float64."""
    rows = logits[first : len(tokens) - 1].astype(np.float64)
    rows = rows - rows.max(axis=1, keepdims=True)
    logz = np.log(np.exp(rows).sum(axis=1))
    target = np.asarray(tokens[first + 1 :])
    return logz - rows[np.arange(len(target)), target]


def perplexity(runner: LlamaCppRunner, tokens: list[int], n_ctx: int, windows: int) -> dict[str, Any]:
    """Consecutive windows of `n_ctx` tokens; first token -> BOS when the model adds one; second half scored."""
    n = min(windows, len(tokens) // n_ctx)
    if n < 1:
        raise ConfigError(f"evaluation text has {len(tokens)} tokens, fewer than one window of {n_ctx}; lower --ppl-ctx or add text")
    nll: list[np.ndarray] = []
    for i in range(n):
        window = list(tokens[i * n_ctx : (i + 1) * n_ctx])
        if runner.add_bos:
            window[0] = runner.bos_id
        logits = runner.logits_np(window)
        nll.append(window_nll(logits, window, n_ctx // 2))
    all_nll = np.concatenate(nll)
    return {"ppl": float(math.exp(all_nll.mean())), "ppl_tokens": int(all_nll.size), "ppl_windows": n}


# ---- one model, measured inside a fresh process ----------------------------------------------


def _rss_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _stat(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "spread": (max(values) - min(values)) / 2}


def _speed(runner: LlamaCppRunner, prompt: list[int], n_gen: int) -> tuple[float, float, float]:
    """(pp tok/s, TTFT s, tg tok/s): prompt in one batch from an empty cache, first token by argmax;
    then n_gen greedy single-token steps after a 1-token prompt (llama-bench's tg)."""
    runner.llm.reset()
    t0 = time.perf_counter()
    runner.llm.eval(prompt)
    t_pp = time.perf_counter() - t0
    token = int(np.argmax(runner.last_logits()))
    ttft = time.perf_counter() - t0
    runner.llm.reset()
    runner.llm.eval([token])
    t0 = time.perf_counter()
    for _ in range(n_gen):
        token = int(np.argmax(runner.last_logits()))
        runner.llm.eval([token])
    t_tg = time.perf_counter() - t0
    return len(prompt) / t_pp, ttft, n_gen / t_tg


def measure_model(path: Path, text: str, cfg: BenchConfig, threads: int, n_gpu_layers: int = 0,
                  extra_buffers: bool = True) -> dict[str, Any]:
    """Every metric for one GGUF file (call in a fresh process for a meaningful peak RSS)."""
    base_rss = _rss_mib("VmRSS")
    loads, runner = [], None
    for _ in range(cfg.repetitions):
        if runner is not None:
            runner.close()
        t0 = time.perf_counter()
        runner = LlamaCppRunner(path, threads, n_ctx=cfg.n_prompt + cfg.n_gen + 8, logits_all=False,
                                n_gpu_layers=n_gpu_layers, extra_buffers=extra_buffers)
        loads.append(time.perf_counter() - t0)
    tokens = runner.tokenize(text)
    body = tokens[1:] if runner.add_bos else tokens
    prompt = (body * (cfg.n_prompt // max(1, len(body)) + 1))[: cfg.n_prompt]
    _speed(runner, prompt[:16], 4)  # warm-up, as llama-bench does
    runs = [_speed(runner, prompt, cfg.n_gen) for _ in range(cfg.repetitions)]
    peak_rss = _rss_mib("VmHWM")
    meta = runner.metadata()
    runner.close()
    ppl_runner = LlamaCppRunner(path, threads, n_ctx=cfg.ppl_ctx, logits_all=True, n_gpu_layers=n_gpu_layers,
                                extra_buffers=extra_buffers)
    ppl = perplexity(ppl_runner, tokens, cfg.ppl_ctx, cfg.ppl_windows)
    ppl_runner.close()
    laco = {k[len("laco_deploy."):]: v for k, v in meta.items() if k.startswith("laco_deploy.")}
    return {
        **ppl,
        "pp_tps": _stat([r[0] for r in runs]),
        "tg_tps": _stat([r[2] for r in runs]),
        "ttft_s": _stat([r[1] for r in runs]),
        "load_s": _stat(loads),
        "size_mib": path.stat().st_size / 2**20,
        "peak_rss_mib": peak_rss,
        "base_rss_mib": base_rss,
        "arch": meta.get("general.architecture"),
        "file_type": meta.get("general.file_type"),
        "pattern": laco.get("pattern"),
        "laco_deploy": laco,
    }


def _worker(job_file: str) -> None:
    """Child-process entry: measure one model, write its metrics as JSON (no torch import here)."""
    job = json.loads(Path(job_file).read_text())
    from laco_deploy.fsutil import write_json

    text = Path(job["text"]).read_text(encoding="utf-8")
    cfg = BenchConfig(**job["cfg"])
    result = measure_model(Path(job["path"]), text, cfg, job["threads"], job["n_gpu_layers"], job["extra_buffers"])
    write_json(Path(job["out"]), result)


# ---- the benchmark -----------------------------------------------------------------------------


def _gpu_layers(device: str) -> int:
    if device == "cpu":
        return 0
    import llama_cpp

    if not llama_cpp.llama_supports_gpu_offload():
        raise ConfigError(f"--device {device}: this llama-cpp-python build has no GPU support; reinstall it with "
                          "CMAKE_ARGS=-DGGML_CUDA=on or use --device cpu")
    return -1


def _run_one(label: str, path: Path, text: str, cfg: BenchConfig, threads: int, n_gpu_layers: int,
             extra_buffers: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix="laco-llamacpp-") as work:
        job, out, text_file = Path(work) / "job.json", Path(work) / "result.json", Path(work) / "eval.txt"
        text_file.write_text(text, encoding="utf-8")
        job.write_text(json.dumps({"path": str(Path(path).resolve()), "text": str(text_file), "cfg": to_dict(cfg),
                                   "threads": threads, "n_gpu_layers": n_gpu_layers, "extra_buffers": extra_buffers,
                                   "out": str(out)}))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        proc = subprocess.run([sys.executable, "-m", "laco_deploy.bench.llamacpp", str(job)], env=env,
                              capture_output=True, text=True)
        if proc.returncode != 0 or not out.is_file():
            tail = (proc.stderr or "").strip().splitlines()[-1:] or ["no output"]
            raise RuntimeBackendError(f"benchmarking {label} ({path}) failed: {tail[0]}")
        return json.loads(out.read_text())


def run_benchmark(models: dict[str, Path], *, eval_spec: str, cfg: BenchConfig, device: str = "cpu") -> BenchResult:
    """Benchmark GGUF files side by side; the first is the reference for speed ratios."""
    errs = cfg.validate()
    if errs:
        raise ConfigError("; ".join(errs))
    for path in models.values():
        _check_gguf_file(Path(path))
    import llama_cpp
    from laco_deploy.progress import progress_bar

    from laco_deploy.data import load_texts

    text = "\n\n".join(load_texts(eval_spec, "eval"))  # documents as in the file llama-perplexity would read
    threads = cfg.threads or physical_cores()
    n_gpu_layers = _gpu_layers(device)
    extra_buffers = extra_buffers_work()
    results: dict[str, dict[str, Any]] = {}
    for label, path in progress_bar(list(models.items()), desc="llama.cpp bench", unit="model"):
        results[label] = _run_one(label, Path(path), text, cfg, threads, n_gpu_layers, extra_buffers)
    ref = next(iter(results.values()))
    for metrics in results.values():
        metrics["tg_speedup"] = metrics["tg_tps"]["median"] / ref["tg_tps"]["median"]
        metrics["pp_speedup"] = metrics["pp_tps"]["median"] / ref["pp_tps"]["median"]
    notes = [NO_SPEEDUP_NOTE] + ([] if extra_buffers else [EXTRA_BUFFERS_NOTE])
    for label, m in results.items():
        if m.get("pattern") and m["pattern"] != "structured":  # "unstructured" or "N:M"
            notes.append(f"{label}: {m['pattern']} sparsity: same tensor shapes and types as a dense model, so llama.cpp "
                         "does the same work; a speed difference from a dense row of the same type is measurement noise")
    environment = {"threads": threads, "device": device, "n_gpu_layers": n_gpu_layers,
                   "llama_cpp_python": llama_cpp.__version__, "extra_buffers": extra_buffers, "cpu": _cpu_name(),
                   "physical_cores": physical_cores(), "load_avg_1m": round(os.getloadavg()[0], 2)}
    return BenchResult(runtime="llama.cpp", environment=environment, protocol=_protocol(cfg, eval_spec),
                       models=results, notes=notes)


def _protocol(cfg: BenchConfig, eval_spec: str) -> dict[str, Any]:
    half = cfg.ppl_ctx // 2
    return {
        "perplexity": (f"llama-perplexity: the {eval_spec} evaluation text is tokenized by each model's own llama.cpp "
                       f"tokenizer; up to {cfg.ppl_windows} consecutive windows of {cfg.ppl_ctx} tokens, the first token "
                       f"of each replaced by BOS when the model adds one; logits at positions {half}..{cfg.ppl_ctx - 2} "
                       f"score the next token ({cfg.ppl_ctx - 1 - half} per window); ppl = exp(mean NLL)"),
        "prompt": f"pp: {cfg.n_prompt} tokens of evaluation text decoded in one batch from an empty cache; tok/s = n / time",
        "generation": f"tg: {cfg.n_gen} greedy tokens one at a time after a 1-token prompt (as llama-bench tg), argmax included",
        "ttft": f"time from submitting the {cfg.n_prompt}-token prompt to having the first generated token",
        "load": "Llama() construction (mmap'd weights, context allocation)",
        "rss": "peak resident set (VmHWM) of a fresh process per model after load and speed runs; base_rss_mib is that "
               "process before loading (Python and libraries)",
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
