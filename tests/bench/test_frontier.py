"""The frontier benchmark's plan, goal checks and report (laco_deploy/bench/frontier.py), on made-up cells."""

import pytest

from tests import tiny

from laco_deploy.bench import frontier as F
from laco_deploy.errors import ConfigError


def _cell(model, quant, size, ppl, tg, domains=None, runtime="llama.cpp"):
    return {"model": model, "quant": quant, "runtime": runtime, "size_mib": size, "ppl": ppl, "tg_tps": tg,
            "pp_tps": 10 * tg, "peak_rss_mib": 300.0, "kl_mean": 0.1, "top1": 0.8, "domains": domains or {}}


def test_plan_orders_families_and_restricts_qa_to_its_type():
    specs = F.plan_models([0.3], ["all", "ffn"], ["pruned", "laco", "qa"], ["wanda50"], ["q4_k_m"])
    assert [s.label for s in specs] == ["dense", "s30-all", "s30-all+laco", "s30-all+qa-q4_k_m", "s30-ffn", "s30-ffn+laco",
                                        "s30-ffn+qa-q4_k_m", "wanda50", "wanda50+laco", "wanda50+qa-q4_k_m"]
    by_label = {s.label: s for s in specs}
    assert by_label["s30-ffn"].prune.targets == F.TARGET_SETS["ffn"] and by_label["s30-ffn"].prune.structured == 0.3
    assert by_label["s30-all+qa-q4_k_m"].base == "s30-all" and by_label["s30-all+qa-q4_k_m"].quant_aware == "q4_k_m"
    cells = F.plan_cells(specs, ["f16", "q4_k_m"], ["q6_k"])
    assert ("s30-all+qa-q4_k_m", "q4_k_m") in cells and ("s30-all+qa-q4_k_m", "f16") not in cells
    assert [m for m, q in cells if q == "q6_k"] == ["dense"]
    assert cells[0] == ("dense", "f16")
    specs = F.plan_models([0.5], ["all"], ["laco"], [], [])  # the pruned model is built as a base, not measured
    assert [s.label for s in specs] == ["dense", "s50-all", "s50-all+laco"]
    assert F.plan_cells(specs, ["f16"], []) == [("dense", "f16"), ("s50-all+laco", "f16")]


def test_plan_adds_the_imatrix_rival_at_its_types():
    specs = F.plan_models([0.3], ["ffn"], ["laco"], [], [])
    cells = F.plan_cells(specs, ["q4_k_m"], ["q2_k"], ["q4_k_m", "q2_k"])
    assert cells == [(F.DENSE_IMATRIX, "q4_k_m"), ("dense", "q4_k_m"), ("s30-ffn+laco", "q4_k_m"),
                     (F.DENSE_IMATRIX, "q2_k"), ("dense", "q2_k")]
    with pytest.raises(ConfigError, match="q8_0.*GGUF k-quants"):
        F.plan_cells(specs, ["f16"], [], ["q8_0"])


def test_equal_size_goal_against_the_imatrix_rival():
    cells = [_cell("dense", "q3_k_m", 89, 21, 100), _cell(F.DENSE_IMATRIX, "q3_k_m", 89, 20, 100),
             _cell("s20-ffn+laco", "q4_k_m", 88, 20.5, 120)]
    (plain,) = F.equal_size_goal(cells)
    (rival,) = F.equal_size_goal(cells, rival=F.DENSE_IMATRIX)
    assert plain["hit"] and not rival["hit"] and f"vs {F.DENSE_IMATRIX} q3_k_m" in rival["goal"]


def test_plan_rejects_unknown_names():
    with pytest.raises(ConfigError, match="bogus"):
        F.plan_models([0.3], ["all"], ["bogus"], [], [])
    with pytest.raises(ConfigError, match="q3_x"):
        F.plan_cells([F.Spec("dense")], ["q3_x"], [])


def test_target_of_picks_the_runtime():
    assert F.target_of("q4_k_m").runtime == "llama.cpp" and F.target_of("int8").runtime == "onnxruntime"


def test_structured_goal_gap_and_speed():
    doms = lambda a, b: {"wikipedia": a, "code": b}  # noqa: E731
    cells = [_cell("dense", "f16", 260, 20, 100, doms(20, 10)), _cell("s30-all", "f16", 190, 100, 125, doms(100, 110)),
             _cell("s30-all+laco", "f16", 190, 40, 125, doms(40, 80))]
    goals = F.structured_goal(cells, "f16")
    assert [round(g["value"], 3) for g in goals] == [0.75, 0.3, 1.25]  # (100-40)/80, (110-80)/100, 125/100
    assert [g["hit"] for g in goals] == [True, False, True]
    assert F.goal_lines(goals)[1].startswith("MISS")


def test_equal_size_goal_compares_with_the_smallest_dense_not_smaller():
    cells = [_cell("dense", "q8_0", 140, 21, 100), _cell("dense", "q6_k", 110, 22, 100), _cell("dense", "q4_k_m", 100, 25, 100),
             _cell("s30-all+laco", "q8_0", 105, 23, 120), _cell("s30-all+laco", "fp32", 105, 1, 120, runtime="onnxruntime")]
    (goal,) = F.equal_size_goal(cells)
    assert "dense q6_k" in goal["goal"] and goal["hit"] is False and goal["value"] == pytest.approx(23 / 22)
    same_type = [_cell("dense", "q8_0", 138.10, 19, 100), _cell("wanda50+laco", "q8_0", 138.12, 28, 100)]
    (goal,) = F.equal_size_goal(same_type)  # a few metadata bytes more still count as the same size
    assert "dense q8_0" in goal["goal"]


def test_qa_goal_pairs_with_laco_at_the_same_type():
    cells = [_cell("wanda50+laco", "q4_k_m", 100, 30, 100), _cell("wanda50+qa-q4_k_m", "q4_k_m", 100, 28, 100),
             _cell("wanda50+laco", "f16", 260, 29, 90)]
    (goal,) = F.qa_goal(cells)
    assert goal["hit"] and goal["value"] == pytest.approx(28 / 30)


def test_report_has_table_plot_and_goals():
    cells = [_cell("dense", "f16", 260, 20, 100, {"wikipedia": 20}), _cell("s30-all", "f16", 190, 100, 130, {"wikipedia": 99})]
    md = F.markdown(cells)
    assert "| s30-all | llama.cpp | f16 | 190.0 | 100.00 |" in md and "ppl wikipedia" in md and "| 1.30 |" in md
    page = F.html_page(cells, F.structured_goal(cells, "f16"), ["settings line"])
    assert "data:image/png;base64," in page and "settings line" in page and "<td>s30-all</td>" in page


def _bench_script():
    """benchmarks/frontier_bench.py as a module."""
    return tiny.benchmark_script("frontier_bench")


def test_measure_stage_takes_only_built_models_and_builds_nothing(tmp_path, monkeypatch):
    """`frontier_bench.py --stage measure` beside a `--stage build` process: finished models only."""
    import importlib
    from types import SimpleNamespace

    bench = _bench_script()

    def never(*a, **k):
        raise AssertionError("the measure stage must not build")

    monkeypatch.setattr(importlib.import_module("laco_deploy.prune"), "run", never)
    monkeypatch.setattr(importlib.import_module("laco_deploy.compensate"), "run", never)
    specs = F.plan_models([0.3], ["ffn"], ["pruned", "laco"], [], [])
    done = tmp_path / "models" / "s30-ffn"
    done.mkdir(parents=True)
    (done / "config.json").write_text("{}")
    (done / "model.safetensors").write_bytes(b"")
    half = tmp_path / "models" / "s30-ffn_laco"  # a build in progress: no weights yet
    half.mkdir()
    (half / "config.json").write_text("{}")
    args = SimpleNamespace(work=tmp_path, samples=8, epochs=1, comp_samples=8)
    dirs = bench.build_models(specs, args, {}, tmp_path / "dense", build=False)
    assert dirs == {F.DENSE: tmp_path / "dense", "s30-ffn": done}


def test_export_cell_passes_the_imatrix_and_redoes_an_export_older_than_it(tmp_path, monkeypatch):
    import os
    from types import SimpleNamespace

    bench = _bench_script()
    calls = []

    class Fake:
        name = "gguf"

        @staticmethod
        def artifact_name(stem, quant):
            return f"{stem}.{quant}.gguf"

        @staticmethod
        def export(src, dest, quant, imatrix=None):
            calls.append(imatrix)
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(b"x")
            return SimpleNamespace(size_bytes=1, wall_s=0.0)

    monkeypatch.setattr(bench.F, "target_of", lambda q: Fake)
    model = tmp_path / "dense"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"")
    imat = tmp_path / "dense.imatrix.gguf"
    imat.write_bytes(b"")
    os.utime(model / "model.safetensors", (1, 1))
    os.utime(imat, (2, 2))
    args = SimpleNamespace(work=tmp_path / "w")
    path = bench.export_cell(F.DENSE_IMATRIX, "q3_k_m", model, args, {}, imat)
    assert path.name == "dense-imatrix.q3_k_m.gguf" and calls == [imat]
    bench.export_cell(F.DENSE_IMATRIX, "q3_k_m", model, args, {}, imat)
    assert len(calls) == 1  # newer than weights and matrix: reused
    os.utime(path, (1.5, 1.5))  # older than the matrix
    bench.export_cell(F.DENSE_IMATRIX, "q3_k_m", model, args, {}, imat)
    assert calls == [imat, imat]
