"""The llama.cpp benchmark: GGUF files measured by the shared harness (bench/harness.py).

This module is the harness's adapter for llama.cpp: in the child process it loads a GGUF file
with llama-cpp-python and tokenizes the evaluation text with the model's own tokenizer; in the
parent it prepares the job (threads, GPU offload, the AMX probe) and says what llama.cpp can
and cannot speed up.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from laco_deploy.artifacts import BenchResult
from laco_deploy.bench import harness
from laco_deploy.config import BenchConfig
from laco_deploy.errors import ConfigError
from laco_deploy.runtimes.cpu import physical_cores
from laco_deploy.runtimes.llamacpp import LlamaCppRunner, check_gguf_file
from laco_deploy.runtimes.llamacpp_probe import EXTRA_BUFFERS_NOTE, extra_buffers_work
from laco_deploy.runtimes.llamacpp_log import raise_pending_interrupt
from laco_deploy.targets import GGUF

MODULE = "laco_deploy.bench.llamacpp_bench"
NO_SPEEDUP_NOTE = ("unstructured and N:M sparsity give no speed-up on llama.cpp: it stores the zeros densely and "
                   "multiplies them like any other weight; only structured pruning (smaller matrices) or a smaller "
                   "weight type makes it faster")
WORDS = {"tokenizer": "llama.cpp's", "cache": "KV cache in llama.cpp",
         "load": "Llama() construction (mmap'd weights, context allocation)", "size": "the .gguf file"}


# ---- inside the child process ------------------------------------------------------------------


class LlamaSession:
    """A GGUF model for the speed runs; perplexity windows go to a second context with all logits."""

    def __init__(self, job: dict[str, Any]):
        self.job, cfg = job, job["cfg"]
        self.runner = self._runner(cfg["n_prompt"] + cfg["n_gen"] + 8, logits_all=False)
        self.scorer: LlamaCppRunner | None = None

    def _runner(self, n_ctx: int, logits_all: bool) -> LlamaCppRunner:
        job = self.job
        return LlamaCppRunner(Path(job["path"]), job["threads"], n_ctx=n_ctx, logits_all=logits_all,
                              n_gpu_layers=job["n_gpu_layers"], extra_buffers=job["extra_buffers"])

    def prefill(self, ids: list[int]) -> np.ndarray:
        self.runner.llm.reset()
        self.runner.llm.eval(ids)
        raise_pending_interrupt()
        return self.runner.last_logits()

    def step(self, token: int) -> np.ndarray:
        self.runner.llm.eval([token])
        raise_pending_interrupt()
        return self.runner.last_logits()

    def window_logits(self, ids: list[int]) -> np.ndarray:
        if self.scorer is None:  # the speed context keeps last logits only: free it, open one with all
            self.runner.close()
            self.scorer = self._runner(self.job["cfg"]["ppl_ctx"], logits_all=True)
        return self.scorer.logits_np(ids)

    def metadata(self) -> dict[str, str]:
        return self.runner.metadata()

    def facts(self) -> dict[str, Any]:
        meta = self.metadata()
        return {"arch": meta.get("general.architecture"), "file_type": meta.get("general.file_type")}

    def close(self) -> None:
        for runner in (self.runner, self.scorer):
            if runner is not None:
                runner.close()


class LlamaCppAdapter:
    def load(self, job: dict[str, Any]) -> LlamaSession:
        return LlamaSession(job)

    def tokens(self, session: LlamaSession, job: dict[str, Any], cfg: BenchConfig) -> dict[str, list]:
        runner = session.runner
        return harness.plan_tokens(runner.tokenize(job["text"]), runner.bos_id if runner.add_bos else None, cfg)


# ---- in the parent -----------------------------------------------------------------------------


def _gpu_layers(device: str) -> int:
    if device == "cpu":
        return 0
    import llama_cpp

    if not llama_cpp.llama_supports_gpu_offload():
        raise ConfigError(f"bench.device {device}: this llama-cpp-python build has no GPU support; reinstall it with "
                          "CMAKE_ARGS=-DGGML_CUDA=on or set bench.device to cpu")
    return -1


def run_benchmark(models: dict[str, Path], *, eval_spec: str, cfg: BenchConfig, device: str = "cpu") -> BenchResult:
    """Benchmark GGUF files side by side; the first is the reference for speed ratios."""
    harness.check_config(cfg)
    for path in models.values():
        check_gguf_file(Path(path))
    import llama_cpp

    threads = cfg.threads or physical_cores()
    n_gpu_layers = _gpu_layers(device)
    extra_buffers = extra_buffers_work()
    job = {"text": harness.eval_text(eval_spec), "threads": threads, "n_gpu_layers": n_gpu_layers,
           "extra_buffers": extra_buffers}
    results = harness.measure_all(GGUF.runtime, MODULE, models, cfg, lambda _path: job, lambda path: path.stat().st_size)
    environment = harness.environment(threads, device, n_gpu_layers=n_gpu_layers, llama_cpp_python=llama_cpp.__version__,
                                      extra_buffers=extra_buffers)
    notes = [NO_SPEEDUP_NOTE] + ([] if extra_buffers else [EXTRA_BUFFERS_NOTE])
    return harness.bench_result(GGUF.runtime, cfg, eval_spec, results, environment=environment, notes=notes, words=WORDS)


if __name__ == "__main__":
    harness.child_main(LlamaCppAdapter())
