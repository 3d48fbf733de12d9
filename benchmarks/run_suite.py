"""Run a benchmark suite (benchmarks/suites/NAME.yaml) and write one JSON result file.

    python benchmarks/run_suite.py ci --out benchmarks/results/ci.json
    laco-deploy bench compare benchmarks/baselines/ci.json benchmarks/results/ci.json

A suite names a build (the same sections as `laco-deploy build --config`) and the metrics to
extract from its manifest, each with a direction and a tolerance. Metrics marked `time: true`
are divided by a reference time measured in the same run (a fixed fp32 matmul workload), so the
result compares across machines and noisy neighbours.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

from laco_deploy.buildconfig import merge
from laco_deploy.fsutil import write_json
from laco_deploy.models import local_model_dir
from laco_deploy.pipeline import build
from laco_deploy.versions import package_versions

SUITES = Path(__file__).parent / "suites"


def reference_seconds(repeats: int = 5) -> float:
    """Median time of a fixed matmul workload (~2 GFLOP): the unit for time metrics."""
    a, b = torch.randn(512, 1024), torch.randn(1024, 1024)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(2):
            a @ b
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def lookup(data: dict, dotted: str):
    node = data
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def run_suite(name: str, out: Path, workdir: Path | None) -> dict:
    spec_path = SUITES / f"{name}.yaml"
    if not spec_path.is_file():
        sys.exit(f"error: suite {name!r} not found; available: {', '.join(p.stem for p in SUITES.glob('*.yaml'))}")
    spec = yaml.safe_load(spec_path.read_text())
    tmp = Path(tempfile.mkdtemp(prefix=f"laco-suite-{name}-")) if workdir is None else workdir
    cfg = merge(spec["build"], {"out": str(tmp / "build")})
    # Convert a GGUF/hub source once before timing: otherwise time.prune includes a one-time
    # conversion on a cold cache (measured: 2.2x the warm prune ratio on a fresh CI machine).
    local_model_dir(cfg.model.model)
    ref_before = reference_seconds()
    manifest = build(cfg)
    ref = statistics.median([ref_before, reference_seconds()])
    metrics = {}
    for metric, m in spec["metrics"].items():
        value = lookup(manifest, m["from"])
        if isinstance(value, dict):
            value = value.get("median")
        if value is not None and m.get("time"):
            value = value / ref
        entry = {"value": value, "better": m.get("better", "lower"), "from": m["from"]}
        entry.update({k: m[k] for k in ("abs", "rel") if k in m})
        metrics[metric] = entry
    result = {"suite": name, "description": spec.get("description", ""), "reference_s": ref,
              "versions": package_versions(), "config": manifest["config"], "metrics": metrics,
              "summary": manifest["summary"]}
    write_json(out, result)
    if workdir is None:
        shutil.rmtree(tmp, ignore_errors=True)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("suite", help="suite name (a file in benchmarks/suites/)")
    p.add_argument("--out", type=Path, required=True, help="result JSON to write")
    p.add_argument("--workdir", type=Path, help="keep the build here instead of a temp folder")
    args = p.parse_args()
    result = run_suite(args.suite, args.out, args.workdir)
    width = max(len(k) for k in result["metrics"])
    for k, v in result["metrics"].items():
        print(f"{k:<{width}}  {v['value']}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
