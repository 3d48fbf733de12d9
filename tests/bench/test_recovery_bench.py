"""The recovery benchmark's zero-shot table, goal and plot (issue 29), on made-up scores; its patterns."""

import pytest

from tests import tiny

from laco_deploy.presets import PRESETS


@pytest.fixture(scope="module")
def rb():
    return tiny.benchmark_script("recovery_bench")


def _zs(arc_norm: float, wino: float) -> dict:
    """Scores of two tasks: arc_easy defines acc_norm (the headline takes it), winogrande only acc."""
    return {"tasks": {"arc_easy": {"metrics": {"acc": {"value": 0.9, "stderr": 0.05},
                                               "acc_norm": {"value": arc_norm, "stderr": 0.04}}, "n": 100},
                      "winogrande": {"metrics": {"acc": {"value": wino, "stderr": 0.03}}, "n": 100}}}


def _result(laco: tuple[float, float], lora: tuple[float, float]) -> dict:
    rows = [("dense", (0.60, 0.60)), ("pruned (Wanda)", (0.40, 0.40)), ("LaCo", laco), ("LoRA", lora)]
    return {"pattern": "unstructured", "rows": [{"model": m, "samples": 8, "zeroshot": _zs(*s)} for m, s in rows]
            + [{"model": "LaCo 1/4 budget", "samples": 2}]}


def test_headline_is_acc_norm_where_defined_and_the_gap_share(rb):
    r = _result((0.52, 0.50), (0.50, 0.50))
    assert rb._headline(r["rows"][2])["value"] == pytest.approx(0.51)  # (0.52 acc_norm + 0.50 acc) / 2, not acc 0.9
    assert rb._gap_recovered(r, "LaCo") == pytest.approx(0.55)  # (0.51 - 0.40) / (0.60 - 0.40)
    table = rb.zeroshot_table([r])
    assert "arc_easy acc_norm %" in table and "winogrande acc %" in table and "gap recovered" in table
    laco_line = next(line for line in table.splitlines() if "| LaCo |" in line)
    assert "52.0 ± 4.0" in laco_line and "51.0 ± 2.5" in laco_line and "55%" in laco_line
    assert "LaCo 1/4" not in table  # not scored


@pytest.mark.parametrize("laco, lora, verdict", [
    ((0.52, 0.50), (0.50, 0.50), ("met", "met")),  # ahead of LoRA, 55% of the gap
    ((0.46, 0.50), (0.50, 0.50), ("NOT met", "NOT met")),  # behind LoRA, 40% of the gap
    ((0.50, 0.50), (0.46, 0.46), ("met", "met")),  # exactly half the gap
])
def test_goal_line_reports_both_halves(rb, laco, lora, verdict):
    line = rb.zeroshot_goal(_result(laco, lora))
    vs_lora, gap = line.split("; gap recovered")
    assert vs_lora.endswith(verdict[0]) and gap.endswith(verdict[1])
    assert "2 tasks, acc_norm where defined" in line


def test_goal_needs_every_model_scored(rb):
    r = _result((0.5, 0.5), (0.5, 0.5))
    r["rows"] = [row for row in r["rows"] if row["model"] != "dense"]
    assert rb.zeroshot_goal(r) is None


def test_plot_is_written(rb, tmp_path):
    path = tmp_path / "zs.png"
    rb.zeroshot_plot([_result((0.52, 0.50), (0.50, 0.50))], path)
    assert path.stat().st_size > 1000


def test_balanced_pattern_is_the_presets_structured_pruning(rb):
    prune = PRESETS["balanced"].settings["prune"]
    assert rb.PATTERNS["balanced"].structured == prune["structured"] and rb.PATTERNS["balanced"].targets == prune["targets"]
