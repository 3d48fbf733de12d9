"""Fidelity stage: score candidates against the dense model on the same evaluation tokens.

PyTorch candidates (Hugging Face directories) and the dense model run on the layer engine
(fidelity/torch_pass.py): walked side by side one decoder layer at a time with weights streamed
from safetensors, which also yields the per-layer error curves; their final norm and LM head then
give the logits window by window. Runtime candidates (GGUF, ONNX exports) are opened through
`laco_deploy.runtimes.runner.open_runner` one at a time, scored against the dense logits of the same
windows and closed before the next one loads. Only one window's logits per model are alive at a
time ([seq, vocab] each).

Under torchrun each rank scores a contiguous shard of the windows; the per-window results and
sums are gathered (in window order, as one process makes them) before the metrics are computed,
and rank 0 writes the reports and runs the zero-shot tasks.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from laco_deploy import distributed
from laco_deploy.artifacts import Artifact
from laco_deploy.checked import Checked, check
from laco_deploy.config import DataConfig, FidelityConfig, ModelConfig, to_dict
from laco_deploy.data import eval_domains, evaluation_windows, in_domain, sample_format
from laco_deploy.divergence import ROW_CHUNK
from laco_deploy.errors import ConfigError, ModelError, RuntimeBackendError
from laco_deploy.fidelity import metrics as M
from laco_deploy.fidelity.gates import evaluate_gates
from laco_deploy.fidelity.provenance import input_hash, tokens_hash, versions
from laco_deploy.fidelity.sums import Stats
from laco_deploy.fidelity.tasks import load_tasks
from laco_deploy.fidelity.torch_pass import DENSE, TorchPass, run_torch_pass
from laco_deploy.fidelity.verdicts import runtime_agreement
from laco_deploy.memory import trim_heap
from laco_deploy.models import load_model, local_model_dir
from laco_deploy.progress import progress_bar
from laco_deploy.runtimes.runner import open_runner
from laco_deploy.targets import target_for_path

log = logging.getLogger(__name__)
SCHEMA_VERSION = 1
REPORT_FILES = {"json": "fidelity.json", "md": "fidelity.md", "html": "fidelity.html"}


@dataclass(frozen=True)
class FidelityResult(Artifact):
    """What `fidelity.json` holds (documented field by field in laco_deploy/fidelity/schema.json)."""

    dense: dict[str, Any]  # model, path, sha256, ppl, nll_mean, tokens_scored
    candidates: dict[str, dict[str, Any]]  # label -> path, runtime, sha256, metrics, kl_* , per_layer, per_window
    gates: list[dict[str, Any]]  # name, candidate, metric, threshold, value, passed, miss
    passed: bool
    settings: dict[str, Any]
    versions: dict[str, str]
    reports: dict[str, str] = field(default_factory=dict)  # kind -> file path
    notes: list[str] = field(default_factory=list)
    zeroshot: dict[str, Any] | None = None  # zero-shot accuracy (fidelity/zeroshot.py) when tasks were given
    runtime_agreement: dict[str, Any] | None = None  # dense PyTorch vs its runtime export, same windows (verdicts.py)
    wall_s: float = 0.0
    schema_version: int = SCHEMA_VERSION


def run(
    model_cfg: ModelConfig,
    data_cfg: DataConfig,
    fid_cfg: FidelityConfig,
    candidates: dict[str, str | Path],
    report_dir: Path,
    *,
    device: torch.device | None = None,
    runtime_dense: str | Path | None = None,
) -> FidelityResult:
    """Compare each candidate with the dense model `model_cfg.model`, write the three reports into
    `report_dir` and return the result. Failed gates set `passed=False`; raising is the caller's call.
    `runtime_dense`: the dense model exported for a runtime (.gguf, ONNX); scored on the same windows,
    it checks that PyTorch and the runtime agree on the dense model (`runtime_agreement`). The settings
    and inputs pass the boundary first (checked.check; a build passes it once and calls run_checked)."""
    checked = check(model_cfg, data_cfg, device, fidelity=fid_cfg)
    return run_checked(checked, candidates, report_dir, runtime_dense=runtime_dense)


def run_checked(c: Checked, candidates: dict[str, str | Path], report_dir: Path, *,
                runtime_dense: str | Path | None = None) -> FidelityResult:
    """`run` on settings and inputs that passed the boundary."""
    model_cfg, data_cfg, fid_cfg, device = c.model, c.data, c.fidelity, c.device
    if not candidates:
        raise ConfigError("no candidate given; pass at least one model to compare, e.g. fidelity.candidate pruned=out/pruned")
    t0 = time.perf_counter()
    zs_tasks = load_tasks(fid_cfg.tasks) if fid_cfg.tasks else None
    runtime_cands, torch_cands = _split_candidates(candidates)
    reference = _runtime_reference(runtime_dense)
    dense_dir = local_model_dir(model_cfg.model)
    tokenizer = _tokenizer(dense_dir, model_cfg)
    ev = _Windows.cut(tokenizer, data_cfg)
    notes: list[str] = []
    dense_nll, dense_by_domain, stats = _score(dense_dir, torch_cands, runtime_cands, reference, ev, device, notes,
                                               model_cfg, fid_cfg)
    ref_stats = stats.pop(_REFERENCE, None)
    zeroshot = None
    if zs_tasks is not None and distributed.is_main():
        from laco_deploy.fidelity.zeroshot import evaluate_models

        zeroshot = evaluate_models(zs_tasks, fid_cfg, tokenizer, _zeroshot_loaders(model_cfg, torch_cands, device),
                                   _zeroshot_skipped(runtime_cands))
    dense_ppl = M.perplexity(*dense_nll)
    dense_domain_ppl = {d: M.perplexity(*sums) for d, sums in dense_by_domain.items()}
    agreement = (_agreement(reference, ref_stats, dense_ppl, dense_domain_ppl, fid_cfg, int(ev.windows.shape[0]), notes)
                 if ref_stats is not None else None)
    cand_out = {label: _candidate_record(label, candidates[label], stats[label], dense_ppl, dense_domain_ppl)
                for label in candidates}
    dense = {"model": model_cfg.model, "path": str(dense_dir), "sha256": input_hash(dense_dir), "ppl": dense_ppl,
             "nll_mean": dense_nll[0] / dense_nll[1], "tokens_scored": dense_nll[1], "domains": {
                 d: {"ppl": dense_domain_ppl[d], "tokens_scored": dense_by_domain[d][1]} for d in ev.per_domain}}
    settings = {**ev.settings(data_cfg), "sample_format": sample_format(tokenizer), "device": str(device),
                "fidelity": to_dict(fid_cfg), "model": to_dict(model_cfg)}
    gates = evaluate_gates(fid_cfg, {label: c["metrics"] for label, c in cand_out.items()})
    report_dir = Path(report_dir)
    result = FidelityResult(dense=dense, candidates=cand_out, gates=gates, passed=all(g["passed"] for g in gates),
                            settings=settings, versions=versions(),
                            reports={kind: str(report_dir / name) for kind, name in REPORT_FILES.items()},
                            notes=notes, zeroshot=zeroshot, runtime_agreement=agreement, wall_s=time.perf_counter() - t0)
    from laco_deploy.fidelity.report import write_reports

    if distributed.is_main():
        write_reports(result, report_dir)
    return result


def _score(dense_dir: Path, torch_cands: dict[str, Path], runtime_cands: dict[str, Path], reference: Path | None,
           ev: _Windows, device: torch.device, notes: list[str], model_cfg: ModelConfig, fid_cfg: FidelityConfig):
    """This rank's shard of the windows through the PyTorch pass, then each runtime candidate (and the
    runtime reference) against the dense logits; -> every rank's (dense nll, per domain, stats) gathered."""
    part = distributed.shard(ev.windows.shape[0], "evaluation windows")  # all of them in one process
    mine, my_domain = ev.windows[part.start:part.stop], ev.window_domain[part.start:part.stop]
    resident = lambda path: _load_resident(path, model_cfg)  # noqa: E731
    tp = run_torch_pass(dense_dir, torch_cands, mine, device, layerwise=fid_cfg.layerwise, notes=notes,
                        load_resident=resident)
    stats = {label: Stats("pytorch", tp.curves[label]) for label in torch_cands}
    dense_nll, dense_by_domain = _score_torch(mine, my_domain, tp, stats)
    tp.release(keep=(DENSE,) if runtime_cands or reference else ())
    for label, path in {**runtime_cands, **({_REFERENCE: reference} if reference else {})}.items():
        stats[label] = _score_runtime(label, path, mine, my_domain, tp, fid_cfg)
    tp.close()
    trim_heap()  # the activation caches' pages go back to the OS before zero-shot loads whole models
    return _gather(dense_nll, dense_by_domain, stats)


@dataclass(frozen=True)
class _Windows:
    """The evaluation windows of every domain, domain after domain."""

    domains: list[tuple[str, str]]  # (label, spec)
    per_domain: dict[str, torch.Tensor]  # label -> [windows, seqlen]
    windows: torch.Tensor  # [n_windows, seqlen]
    window_domain: list[str]  # each window's domain label

    @classmethod
    def cut(cls, tokenizer, data_cfg: DataConfig) -> _Windows:
        domains = eval_domains(data_cfg.eval)
        per_domain = {label: evaluation_windows(tokenizer, spec, data_cfg.eval_samples, data_cfg.seqlen)
                      for label, spec in domains}
        return cls(domains, per_domain, torch.cat(list(per_domain.values())),
                   [label for label, w in per_domain.items() for _ in range(w.shape[0])])

    def settings(self, data_cfg: DataConfig) -> dict[str, Any]:
        """The report's record of what was scored (keys in the report's order)."""
        return {"eval": data_cfg.eval, "eval_samples": data_cfg.eval_samples, "windows": int(self.windows.shape[0]),
                "domains": [{"label": label, "spec": spec, "windows": int(self.per_domain[label].shape[0]),
                             "in_domain": in_domain(spec, data_cfg.calib)} for label, spec in self.domains],
                "seqlen": data_cfg.seqlen, "tokens_sha256": tokens_hash(self.windows)}


def _gather(dense_nll: tuple[float, int], by_domain: dict[str, tuple[float, int]], stats: dict[str, Stats]):
    """Every rank's window results, merged in rank (= window) order; unchanged in one process."""
    if distributed.world() == 1:
        return dense_nll, by_domain, stats
    parts = distributed.gather_all((dense_nll, by_domain, stats))
    nll, merged_domain, merged = parts[0]
    for other_nll, other_domain, other_stats in parts[1:]:
        nll = (nll[0] + other_nll[0], nll[1] + other_nll[1])
        for d, (s, n) in other_domain.items():
            s0, n0 = merged_domain.get(d, (0.0, 0))
            merged_domain[d] = (s0 + s, n0 + n)
        for label, st in other_stats.items():
            merged[label].absorb(st)
    return nll, merged_domain, merged


_REFERENCE = "dense (runtime reference)"  # stats key of `runtime_dense`; never a candidate


def _runtime_reference(path: str | Path | None) -> Path | None:
    p = Path(path) if path is not None else None
    if p is not None and (not p.exists() or target_for_path(p) is None):
        raise ModelError(f"runtime reference {path} is not an existing runtime export; pass the dense model exported "
                         "as a .gguf file or an ONNX folder/.onnx file")
    return p


def _agreement(path: Path, st: Stats, dense_ppl: float, dense_domain_ppl: dict[str, float], fid_cfg: FidelityConfig,
               windows: int, notes: list[str]) -> dict[str, Any]:
    """Dense PyTorch vs the dense runtime export on the same windows; a disagreement is logged loudly
    and noted in the report."""
    m = st.metrics(dense_ppl)
    domains = {d: (dense_domain_ppl[d], sums.metrics(dense_domain_ppl[d])["ppl"]) for d, sums in st.domains.items()}
    rec = runtime_agreement(st.runtime, str(path), dense_ppl, m["ppl"], fid_cfg.runtime_ppl_tolerance,
                            kl_mean=m["kl"]["mean"], top1=m["top1"], domains=domains, windows=windows)
    if rec["agree"]:
        log.info("%s", rec["message"])
    else:
        log.warning("%s", rec["message"])
        notes.append(rec["message"])
    return rec


def _split_candidates(candidates: dict[str, str | Path]) -> tuple[dict[str, Path], dict[str, Path]]:
    """(runtime exports, PyTorch directories), each in the given order; a missing path is an error."""
    runtime, torch_dirs = {}, {}
    for label, path in candidates.items():
        p = Path(path)
        if not p.exists():
            raise ModelError(f"candidate {path} not found; pass a Hugging Face directory, an .onnx file/folder or a .gguf file")
        (runtime if target_for_path(p) is not None else torch_dirs)[label] = p
    return runtime, torch_dirs


def _tokenizer(dense_dir: Path, model_cfg: ModelConfig):
    from laco_deploy.tokenizer import load_tokenizer

    try:
        return load_tokenizer(dense_dir, trust_remote_code=model_cfg.trust_remote_code)
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot load the tokenizer of {dense_dir}: {e}") from e


def _load_resident(path: Path, model_cfg: ModelConfig):
    """A model without safetensors weights, loaded whole (pickles only with --allow-pickle)."""
    return load_model(str(path), allow_pickle=model_cfg.allow_pickle, trust_remote_code=model_cfg.trust_remote_code).model


def _score_torch(windows: torch.Tensor, window_domain: list[str], tp: TorchPass,
                 stats: dict[str, Stats]) -> tuple[tuple[float, int], dict[str, tuple[float, int]]]:
    """Window by window: dense logits once, every PyTorch candidate compared with them.
    Returns the dense (NLL sum, count) over all windows and per domain."""
    nll_sum, nll_count = 0.0, 0
    by_domain: dict[str, tuple[float, int]] = {}
    for w in progress_bar(range(windows.shape[0]), desc="fidelity", unit="window"):
        ids, domain = windows[w], window_domain[w]
        d_logits = tp.logits(DENSE, w)
        nll = M.next_token_nll(d_logits, ids)
        nll_sum, nll_count = nll_sum + nll.sum().item(), nll_count + nll.numel()
        d_sum, d_count = by_domain.get(domain, (0.0, 0))
        by_domain[domain] = (d_sum + nll.sum().item(), d_count + nll.numel())
        for label, st in stats.items():
            c_logits = tp.logits(label, w)
            _check_logits(label, c_logits, d_logits, w)
            st.add(d_logits, c_logits, ids, domain)
            del c_logits  # [seq, vocab] each (268 MiB at Gemma's vocabulary): never two windows' at once
        del d_logits
        trim_heap()  # the comparisons fragment the heap (40 windows, 2 candidates: 707 -> 639 MiB trimmed)
    return (nll_sum, nll_count), by_domain


def _score_runtime(label: str, path: Path, windows: torch.Tensor, window_domain: list[str], tp: TorchPass,
                   fid_cfg: FidelityConfig) -> Stats:
    """One runtime candidate over every window against the dense logits; its runner is closed
    (and its memory released) before the next candidate opens."""
    runner = open_runner(path, device=tp.device, threads=fid_cfg.threads, max_tokens=windows.shape[1])
    try:
        st = Stats(runner.name, None)
        for w in progress_bar(range(windows.shape[0]), desc="fidelity", unit="window"):
            d_logits = tp.logits(DENSE, w)
            c_logits = _runner_logits(label, runner, windows[w])
            _check_logits(label, c_logits, d_logits, w)
            st.add(d_logits, c_logits, windows[w], window_domain[w])
            del d_logits, c_logits  # freed before the next window's are made, not after
            # onnxruntime's and the comparison's temporaries fragment the heap: untrimmed, the first
            # session grew 1,141 -> 1,483 MiB anonymous over 80 windows; trimmed it stays ~1,180
            trim_heap()
        return st
    finally:
        close = getattr(runner, "close", None)
        if close is not None:
            close()
        del runner
        gc.collect()
        trim_heap()


def _zeroshot_loaders(model_cfg: ModelConfig, torch_cands: dict[str, Path], device: torch.device) -> dict[str, Any]:
    """label -> function loading that model whole on `device`: the harness scores one model at a time."""
    def loader(spec: str, **kw):
        return lambda: load_model(spec, **kw).model.to(device).eval()

    # every model is asked with the dense model's tokenizer, loaded once (tokenizer=False: none per model)
    kw = {"allow_pickle": model_cfg.allow_pickle, "trust_remote_code": model_cfg.trust_remote_code, "tokenizer": False}
    return {DENSE: loader(model_cfg.model, **kw), **{label: loader(str(p), **kw) for label, p in torch_cands.items()}}


def _zeroshot_skipped(runtime_cands: dict[str, Path]) -> dict[str, str]:
    out = {}
    for label, path in runtime_cands.items():
        runtime = target_for_path(path).runtime
        out[label] = f"{runtime} candidate: lm-evaluation-harness runs the PyTorch models only"
        log.info("zero-shot: skipping %s (%s runtime): lm-evaluation-harness scores PyTorch models only", label, runtime)
    return out


def _runner_logits(label: str, runner, ids: torch.Tensor) -> torch.Tensor:
    try:
        return runner.logits(ids).float()
    except RuntimeBackendError:
        raise
    except Exception as e:  # runtimes raise their own exception types
        raise RuntimeBackendError(f"candidate {label} ({runner.name}) failed to compute logits: {type(e).__name__}: {e}; "
                                  "check that the export completed and matches this runtime version") from e


def _check_logits(label: str, cand: torch.Tensor, dense: torch.Tensor, window: int) -> None:
    if cand.shape != dense.shape:
        raise ModelError(f"candidate {label} returned logits of shape {tuple(cand.shape)} but the dense model {tuple(dense.shape)}; "
                         "compare models that share the dense model's tokenizer and vocabulary")
    if not all(torch.isfinite(cand[s : s + ROW_CHUNK]).all() for s in range(0, cand.shape[0], ROW_CHUNK)):
        raise RuntimeBackendError(f"candidate {label} produced NaN or infinite logits in evaluation window {window}; "
                                  "the model or its export is broken (try a wider weight type, e.g. fp32 or q8_0)")


def _candidate_record(label: str, path: str | Path, st: Stats, dense_ppl: float,
                      dense_domain_ppl: dict[str, float]) -> dict[str, Any]:
    kl = torch.cat(st.kl).double()
    q = torch.linspace(0, 1, 101, dtype=torch.float64)
    return {
        "path": str(path),
        "runtime": st.runtime,
        "sha256": input_hash(Path(path)),
        "metrics": st.metrics(dense_ppl),
        "domains": {d: sums.metrics(dense_domain_ppl[d]) for d, sums in st.domains.items()},
        "kl_quantiles": {"q": q.tolist(), "value": torch.quantile(kl, q).tolist()},
        "kl_histogram": M.log_histogram(kl),
        "per_layer": st.curves.to_list() if st.curves is not None else None,
        "per_window": st.per_window,
    }
