"""The onnxruntime benchmark: ONNX exports measured by the shared harness (bench/harness.py).

This module is the harness's adapter for onnxruntime: the parent tokenizes the evaluation text
with each export's own tokenizer (transformers stays out of the child), and the child drives an
OrtDecoder with the KV cache kept in onnxruntime (IO binding).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from laco_deploy.artifacts import BenchResult
from laco_deploy.bench import harness
from laco_deploy.config import BenchConfig
from laco_deploy.errors import RuntimeBackendError
from laco_deploy.runtimes.cpu import physical_cores
from laco_deploy.runtimes.onnxrt import OrtDecoder, model_file, providers_for
from laco_deploy.targets import ONNX

MODULE = "laco_deploy.bench.onnxrt_bench"
NO_SPEEDUP_NOTE = ("unstructured and N:M sparsity give no speed-up on onnxruntime: its kernels are dense and sparse "
                   "storage is densified at load; only structured pruning (smaller matrices) or int8 makes it faster")
WORDS = {"tokenizer": "the export's tokenizer files, read by transformers in the parent process",
         "cache": "KV cache kept in onnxruntime memory through IO binding",
         "load": "InferenceSession construction with full graph optimisation (sparse storage: densify included)",
         "size": "graph and weight files of the export (tokenizer and configs not counted)"}


# ---- inside the child process ------------------------------------------------------------------


class OrtSession:
    """An OrtDecoder that remembers its past between decode steps."""

    def __init__(self, job: dict[str, Any]):
        self.decoder = OrtDecoder(Path(job["path"]), device=job["device"], threads=job["threads"])
        self.past: list = []
        self.position = 0

    def prefill(self, ids: list[int]) -> np.ndarray:
        logits, self.past = self.decoder.prefill(np.asarray(ids, dtype=np.int64))
        self.position = len(ids)
        return logits[-1]

    def step(self, token: int) -> np.ndarray:
        logits, self.past = self.decoder.step(token, self.position, self.past)
        self.position += 1
        return logits

    def window_logits(self, ids: list[int]) -> np.ndarray:
        logits, _ = self.decoder.prefill(np.asarray(ids, dtype=np.int64))
        return logits

    def metadata(self) -> dict[str, str]:
        return dict(self.decoder.session.get_modelmeta().custom_metadata_map)

    def facts(self) -> dict[str, Any]:
        d = self.decoder
        quant = self.metadata().get(harness.LACO_PREFIX + "quant")
        return {"provider": d.provider, "threads": d.threads, "kv_dtype": np.dtype(d.kv_dtype).name, "quant": quant}

    def close(self) -> None:
        self.past, self.decoder = [], None  # onnxruntime frees the session with its last reference


class OrtAdapter:
    def load(self, job: dict[str, Any]) -> OrtSession:
        return OrtSession(job)

    def tokens(self, session: OrtSession, job: dict[str, Any], cfg: BenchConfig) -> dict[str, list]:
        return job["plan"]


# ---- in the parent -----------------------------------------------------------------------------


def export_bytes(path: Path) -> int:
    """Bytes of an export's graph and weight files (folder) or of an .onnx file and its data."""
    from exporters.onnx_sparse import DENSE_FILE, SPARSE_FILE

    f = model_file(path)
    names = [f.name, f.name + "_data", f.name + ".data", SPARSE_FILE, DENSE_FILE]
    return sum((f.parent / n).stat().st_size for n in dict.fromkeys(names) if (f.parent / n).is_file())


def eval_tokens(path: Path, eval_spec: str, cfg: BenchConfig) -> dict[str, list]:
    """The evaluation text tokenized by the export's tokenizer -> harness.plan_tokens (windows, prompt)."""
    from transformers import AutoTokenizer

    folder = model_file(path).parent
    try:
        tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise RuntimeBackendError(f"no tokenizer next to {model_file(path)} ({e}); benchmark an export folder written with export.target onnx") from e
    ids = tok(harness.eval_text(eval_spec))["input_ids"]
    bos = tok.bos_token_id
    adds_bos = bos is not None and len(ids) > 0 and ids[0] == bos
    return harness.plan_tokens(ids, bos if adds_bos else None, cfg)


def run_benchmark(models: dict[str, Path], *, eval_spec: str, cfg: BenchConfig, device: str = "cpu") -> BenchResult:
    """Benchmark ONNX exports side by side; the first is the reference for speed ratios."""
    import onnxruntime as ort

    harness.check_config(cfg)
    for path in models.values():
        model_file(Path(path))
    providers_for(device)  # a missing CUDA provider fails here, before any work
    threads = cfg.threads or physical_cores()

    def job_for(path: Path) -> dict[str, Any]:
        return {"device": device, "threads": threads, "plan": eval_tokens(path, eval_spec, cfg)}

    results = harness.measure_all(ONNX.runtime, MODULE, models, cfg, job_for, export_bytes)
    environment = harness.environment(threads, device, provider=next(iter(results.values()))["provider"],
                                      onnxruntime=ort.__version__)
    return harness.bench_result(ONNX.runtime, cfg, eval_spec, results, environment=environment,
                                notes=[NO_SPEEDUP_NOTE], words=WORDS)


if __name__ == "__main__":
    harness.child_main(OrtAdapter())
