"""Zero-shot accuracy through lm-evaluation-harness on tiny models, offline: the table in the reports,
agreement with a direct log-likelihood computation, structured-pruned candidates, skipped runtimes."""

from __future__ import annotations

import json
import logging
import math
import socket
from importlib import resources

import jsonschema
import pytest
import torch

from laco_deploy.config import DataConfig, FidelityConfig, ModelConfig
from laco_deploy.fidelity import run
from laco_deploy.fidelity import zeroshot as Z
from laco_deploy.fidelity.tasks import TASKS_DIR, load_tasks

SAMPLE = "laco_sample_mc"
DATA = DataConfig(eval="builtin", eval_samples=1, seqlen=32)


@pytest.fixture()
def offline(tmp_path, monkeypatch):
    """No hub and no network at all: offline flags set, a fresh datasets cache, and every socket
    connection refused, so a hidden download would fail the test instead of passing by luck."""
    import datasets
    import huggingface_hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    assert datasets.config.HF_HUB_OFFLINE and huggingface_hub.constants.HF_HUB_OFFLINE  # read at import (tests/conftest.py)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets")

    def refuse(self, address, *args):
        raise OSError(f"network access in an offline test: {address}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)


@pytest.fixture(scope="module")
def sample_result(tmp_path_factory, trained_dir, perturbed_dirs):
    """dense vs an identical copy vs the strongly perturbed copy, on the shipped sample task."""
    out = tmp_path_factory.mktemp("zs_report")
    cands = {"same": trained_dir, "noisy": perturbed_dirs[max(perturbed_dirs)]}
    with pytest.MonkeyPatch.context() as mp:  # the `offline` fixture, at module scope
        import datasets

        mp.setattr(datasets.config, "HF_DATASETS_CACHE", out / "hf-datasets")
        mp.setattr(socket.socket, "connect", lambda self, address, *a: (_ for _ in ()).throw(OSError("offline test")))
        result = run(ModelConfig(model=str(trained_dir), device="cpu"), DATA, FidelityConfig(tasks=(SAMPLE,), layerwise=False),
                     cands, out)
    return result, out


def test_sample_task_table_offline(sample_result):
    result, out = sample_result
    doc = json.loads((out / "fidelity.json").read_text())
    jsonschema.validate(doc, json.loads(resources.files("laco_deploy.fidelity").joinpath("schema.json").read_text()))
    zs = doc["zeroshot"]
    assert list(zs["models"]) == ["dense", "same", "noisy"] and zs["skipped"] == {}
    assert zs["tasks"][SAMPLE] == {"kind": "shipped", "source": str(TASKS_DIR / f"{SAMPLE}.yaml"),
                                   "data_files": [str(TASKS_DIR / f"{SAMPLE}.jsonl")], "split": "test", "docs": 24,
                                   "output_type": "multiple_choice"}
    assert zs["settings"]["num_fewshot"] == 0 and zs["versions"]["lm_eval"] == doc["versions"]["lm_eval"]
    for label, m in zs["models"].items():
        score = m["tasks"][SAMPLE]
        assert score["n"] == 24 and set(score["metrics"]) == {"acc", "acc_norm"}
        for s in score["metrics"].values():  # the harness's stderr of a mean of 0/1 outcomes (n - 1 in the variance)
            assert 0 <= s["value"] <= 1 and s["stderr"] == pytest.approx(math.sqrt(s["value"] * (1 - s["value"]) / 23))
    assert zs["models"]["same"]["tasks"] == zs["models"]["dense"]["tasks"]  # same weights, same answers
    md = (out / "fidelity.md").read_text()
    assert "Zero-shot accuracy (lm-evaluation-harness, 0-shot" in md and "| task | metric | n | dense | same | noisy |" in md
    acc = zs["models"]["dense"]["tasks"][SAMPLE]["metrics"]["acc"]
    assert f"| {SAMPLE} | acc | 24 | {100 * acc['value']:.1f} ± {100 * acc['stderr']:.1f} |" in md
    assert "test split, 24 documents" in md
    html = (out / "fidelity.html").read_text()
    assert "Zero-shot accuracy" in html and f"<td>{SAMPLE}</td>" in html


def test_accuracy_equals_a_direct_loglikelihood_computation(sample_result, trained_dir, perturbed_dirs, bpe_tokenizer):
    """acc = argmax of the summed log-probabilities of each answer's tokens; acc_norm divides by the
    answer's length in characters (the harness's definitions), computed here without the harness."""
    from transformers import AutoModelForCausalLM

    rows = [json.loads(line) for line in (TASKS_DIR / f"{SAMPLE}.jsonl").read_text().splitlines()]
    doc = sample_result[0].zeroshot
    for label, path in (("dense", trained_dir), ("noisy", perturbed_dirs[max(perturbed_dirs)])):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        hits = hits_norm = 0
        for row in rows:
            context = f"Question: {row['question']}\nAnswer:"
            lls = [_loglikelihood(model, bpe_tokenizer, context, " " + choice) for choice in row["choices"]]
            hits += max(range(4), key=lambda i: lls[i]) == row["answer"]
            hits_norm += max(range(4), key=lambda i: lls[i] / len(row["choices"][i])) == row["answer"]
        metrics = doc["models"][label]["tasks"][SAMPLE]["metrics"]
        assert metrics["acc"]["value"] == pytest.approx(hits / 24) and metrics["acc_norm"]["value"] == pytest.approx(hits_norm / 24)


@torch.no_grad()
def _loglikelihood(model, tok, context: str, continuation: str) -> float:
    whole, ctx = tok.encode(context + continuation), tok.encode(context)
    logp = torch.log_softmax(model(torch.tensor([whole[:-1]])).logits[0].double(), -1)  # [seq - 1, vocab]
    return sum(logp[i - 1, whole[i]].item() for i in range(len(ctx), len(whole)))


def test_structured_pruned_candidate_is_scored_as_loaded(tiny_llama_dir, tmp_path, offline):
    """A structured-pruned directory (narrower layers) loads through models.load_model and runs in the harness."""
    from laco_deploy.config import PruneConfig
    from laco_deploy.models import load_model
    from laco_deploy.prune import run as prune

    pruned = tmp_path / "structured"
    prune(ModelConfig(model=str(tiny_llama_dir), device="cpu"), DataConfig(samples=4, seqlen=32), PruneConfig(structured=0.5), pruned)
    loaded = load_model(str(pruned))
    assert loaded.model.model.layers[0].mlp.gate_proj.out_features < 128  # narrower than the dense 2 x hidden
    result = run(ModelConfig(model=str(tiny_llama_dir), device="cpu"), DATA,
                 FidelityConfig(tasks=(SAMPLE,), task_limit=6, layerwise=False), {"structured": pruned}, tmp_path / "rep")
    scores = result.zeroshot["models"]["structured"]["tasks"][SAMPLE]
    assert scores["n"] == 6 and 0 <= scores["metrics"]["acc"]["value"] <= 1


def test_other_runtimes_are_skipped_with_one_log_line(tiny_llama_dir, bpe_tokenizer, caplog, offline):
    from laco_deploy.runtimes.runner import TorchRunner
    from laco_deploy.models import load_model

    class GGUFRunner:  # stands in for a llama.cpp candidate: no PyTorch model inside
        name = "llama.cpp"

    model = load_model(str(tiny_llama_dir)).model
    tasks = load_tasks([SAMPLE])
    with caplog.at_level(logging.INFO, logger="laco_deploy.fidelity.zeroshot"):
        zs = Z.evaluate_runners(tasks, FidelityConfig(tasks=(SAMPLE,), task_limit=4), bpe_tokenizer, model,
                                {"pruned": TorchRunner(model), "gguf-q8_0": GGUFRunner()})
    assert list(zs["models"]) == ["dense", "pruned"] and list(zs["skipped"]) == ["gguf-q8_0"]
    lines = [r.getMessage() for r in caplog.records if "gguf-q8_0" in r.getMessage()]
    assert len(lines) == 1 and "skipping gguf-q8_0 (llama.cpp runtime)" in lines[0]
    assert any("not scored: gguf-q8_0" in n for n in Z.notes(zs))


def test_mean_over_tasks_and_its_standard_error():
    scores = {"a": {"metrics": {"acc": {"value": 0.5, "stderr": 0.3}, "acc_norm": {"value": 0.6, "stderr": 0.1}}, "n": 10},
              "b": {"metrics": {"acc": {"value": 0.7, "stderr": 0.4}}, "n": 10}}
    mean = Z.mean_over_tasks(scores)
    assert mean["acc"] == {"value": pytest.approx(0.6), "stderr": pytest.approx(0.25), "tasks": 2}
    assert mean["acc_norm"] == {"value": 0.6, "stderr": 0.1, "tasks": 1}  # only the tasks that report it
    head, rows = Z.table({"tasks": {"a": {}, "b": {}}, "models": {"dense": {"tasks": scores, "mean": mean}}})
    assert head == ("task", "metric", "n", "dense")
    assert rows[0] == ("a", "acc", "10", "50.0 ± 30.0") and ("mean over 2 tasks", "acc", "", "60.0 ± 25.0") in rows


def test_accuracy_over_tasks_takes_acc_norm_where_a_task_defines_it():
    scores = {"a": {"metrics": {"acc": {"value": 0.5, "stderr": 0.3}, "acc_norm": {"value": 0.6, "stderr": 0.1}}, "n": 10},
              "b": {"metrics": {"acc": {"value": 0.7, "stderr": 0.4}}, "n": 10},
              "c": {"metrics": {"perplexity": {"value": 12.0, "stderr": 1.0}}, "n": 10}}
    head = Z.accuracy_over_tasks(scores)
    assert head["metrics"] == {"a": "acc_norm", "b": "acc"}  # c reports no accuracy
    assert head["stderr"] == pytest.approx((0.1 ** 2 + 0.4 ** 2) ** 0.5 / 2) and head["tasks"] == 2
    assert Z.accuracy_over_tasks({"c": scores["c"]}) is None


def test_lastword_accuracy_is_the_greedy_whole_word(trained_dir, bpe_tokenizer, offline):
    """laco_lastword's acc: every token of " target" is the model's argmax after the context (the
    harness's is_greedy); perplexity: exp of minus the mean log-likelihood of " target" per item;
    both computed here without the harness on the first items."""
    from transformers import AutoModelForCausalLM

    n = 6
    model = AutoModelForCausalLM.from_pretrained(trained_dir, dtype=torch.float32).eval()
    zs = Z.evaluate_models(load_tasks(["laco_lastword"]), FidelityConfig(tasks=("laco_lastword",), task_limit=n),
                           bpe_tokenizer, {"dense": model})
    rows = [json.loads(line) for line in (TASKS_DIR / "laco_lastword.jsonl").read_text().splitlines()][:n]
    hits, lls = 0, []
    with torch.no_grad():
        for row in rows:
            whole, ctx = bpe_tokenizer.encode(row["context"] + " " + row["target"]), bpe_tokenizer.encode(row["context"])
            pred = model(torch.tensor([whole[:-1]])).logits[0].argmax(-1)
            hits += all(pred[i - 1].item() == whole[i] for i in range(len(ctx), len(whole)))
            lls.append(_loglikelihood(model, bpe_tokenizer, row["context"], " " + row["target"]))
    metrics = zs["models"]["dense"]["tasks"]["laco_lastword"]["metrics"]
    assert metrics["acc"]["value"] == pytest.approx(hits / n)
    assert metrics["perplexity"]["value"] == pytest.approx(math.exp(-sum(lls) / n), rel=1e-4)
