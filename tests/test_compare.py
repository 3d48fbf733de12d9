"""`bench compare`: tolerances, directions, and exit codes with injected regressions."""

from __future__ import annotations

import copy
import json

import pytest

from laco_deploy.bench.compare import compare, failed

BASE = {
    "suite": "ci",
    "metrics": {
        "ppl.laco": {"value": 30.0, "better": "lower", "rel": 0.02},
        "top1.laco": {"value": 0.80, "better": "higher", "abs": 0.01},
        "time.compensate_vs_ref": {"value": 10.0, "better": "lower", "rel": 0.5},
        "speed.tg_vs_dense": {"value": 1.0, "better": "higher", "rel": 0.2},
        "sparsity": {"value": 0.5, "better": "equal", "abs": 0.001},
    },
}


def _with(**changes):
    cur = copy.deepcopy(BASE)
    for name, value in changes.items():
        cur["metrics"][name.replace("__", ".")]["value"] = value
    return cur


def test_identical_passes():
    assert failed(compare(BASE, copy.deepcopy(BASE))) == []


@pytest.mark.parametrize(
    "changes,bad",
    [
        ({"ppl__laco": 30.5}, []),  # +1.7% within rel 2%
        ({"ppl__laco": 31.0}, ["ppl.laco"]),  # +3.3%
        ({"ppl__laco": 25.0}, []),  # better
        ({"top1__laco": 0.785}, ["top1.laco"]),
        ({"top1__laco": 0.95}, []),
        ({"time__compensate_vs_ref": 14.0}, []),  # times are noisy: 40% slower is tolerated
        ({"time__compensate_vs_ref": 16.0}, ["time.compensate_vs_ref"]),
        ({"speed__tg_vs_dense": 0.7}, ["speed.tg_vs_dense"]),
        ({"sparsity": 0.45}, ["sparsity"]),  # "equal": any drift beyond abs is a regression
    ],
)
def test_regressions_detected(changes, bad):
    rows = compare(BASE, _with(**changes))
    assert sorted(r.name for r in failed(rows)) == bad


def test_missing_metric_is_a_failure_and_new_is_reported():
    cur = copy.deepcopy(BASE)
    del cur["metrics"]["ppl.laco"]
    cur["metrics"]["kl.laco"] = {"value": 0.1, "better": "lower"}
    rows = {r.name: r.status for r in compare(BASE, cur)}
    assert rows["ppl.laco"] == "missing" and rows["kl.laco"] == "new"


def test_cli_exit_codes(tmp_path, cli):
    b, c = tmp_path / "b.json", tmp_path / "c.json"
    b.write_text(json.dumps(BASE))
    c.write_text(json.dumps(BASE))
    code, out, _ = cli("bench", "compare", b, c)
    assert code == 0 and "no regression" in out
    c.write_text(json.dumps(_with(ppl__laco=40.0)))
    md = tmp_path / "cmp.md"
    code, out, err = cli("bench", "compare", b, c, "--markdown", md)
    assert code == 1 and "REGRESSED" in out and "ppl.laco" in err
    assert "| ppl.laco | 30 | 40 |" in md.read_text()
    code, _, _ = cli("bench", "compare", b, c, "--tolerance", "ppl.laco=rel:0.5")
    assert code == 0
    code, _, err = cli("bench", "compare", b, tmp_path / "none.json")
    assert code == 2 and "not found" in err
    code, _, err = cli("bench", "compare", b, c, "--tolerance", "ppl.laco=0.5")
    assert code == 2 and "METRIC=rel:0.1" in err
