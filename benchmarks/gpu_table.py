"""The table of benchmarks/gpu_check.py and how its steps run (child processes with timeouts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(cmd: list[str], timeout: float) -> tuple[int, str, float]:
    """(exit code, last lines of output, seconds); a timeout counts as a failure (124)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
           "TQDM_DISABLE": "1"}
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=max(timeout, 1))
        code, text = p.returncode, (p.stdout + p.stderr)
    except subprocess.TimeoutExpired as e:
        code, text = 124, f"timed out after {timeout:.0f} s: {(e.stderr or b'')[-500:]!r}"
    return code, "\n".join(text.strip().splitlines()[-3:]), time.perf_counter() - t0


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "laco_deploy.cli", "--quiet", *args]


class Table:
    def __init__(self, budget_s: float, title: str) -> None:
        self.rows: list[dict] = []
        self.notes: list[str] = []
        self.budget_s, self.title = budget_s, title
        self.t0 = time.perf_counter()

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.t0)

    def note(self, text: str) -> None:
        self.notes.append(text)
        print(f"[note] {text}", file=sys.stderr, flush=True)

    def add(self, check: str, ok: bool | None, seconds: float, detail: str) -> None:
        status = "ok" if ok else "skipped" if ok is None else "FAILED"
        self.rows.append({"check": check, "status": status, "seconds": round(seconds, 1), "detail": detail})
        print(f"[{status}] {check} ({seconds:.0f} s): {detail}", file=sys.stderr, flush=True)

    def failed(self) -> bool:
        return any(r["status"] == "FAILED" for r in self.rows)

    def print(self, out: Path | None = None) -> None:
        total = time.perf_counter() - self.t0
        print(f"gpu_check on {self.title}\n")
        for n in self.notes:
            print(f"- {n}")
        print("\n| check | status | s | detail |\n|---|---|---|---|")
        for r in self.rows:
            detail = r["detail"].replace("|", "/").replace("\n", " ")[:400]
            print(f"| {r['check']} | {r['status']} | {r['seconds']:.0f} | {detail} |")
        print(f"\ntotal {total:.0f} s (budget {self.budget_s:.0f} s)")
        if out is not None:
            out.write_text(json.dumps({"title": self.title, "notes": self.notes, "rows": self.rows,
                                       "total_s": round(total, 1)}, indent=2) + "\n")
