"""`laco_deploy.fidelity.run` on tiny models: identical, perturbed, runtime-like fake runners, reports."""

from __future__ import annotations

import base64
import math
import json
import re
from importlib import resources
from pathlib import Path

import jsonschema
import pytest
import torch

from laco_deploy.config import DataConfig, FidelityConfig, ModelConfig
from laco_deploy.errors import ModelError, RuntimeBackendError
from laco_deploy.fidelity import FidelityResult, run
from laco_deploy.fidelity import evaluate as fid_eval

DATA = DataConfig(eval="builtin", eval_samples=3, seqlen=48)


def _run(dense: Path, candidates: dict, report: Path, fid: FidelityConfig | None = None) -> FidelityResult:
    return run(ModelConfig(model=str(dense), device="cpu"), DATA, fid or FidelityConfig(), candidates, report)


def _schema() -> dict:
    return json.loads(resources.files("laco_deploy.fidelity").joinpath("schema.json").read_text())


def _validate(report_dir: Path) -> dict:
    doc = json.loads((report_dir / "fidelity.json").read_text())
    jsonschema.validate(doc, _schema())
    return doc


@pytest.fixture(scope="module")
def perturbed_result(trained_dir, perturbed_dirs, tmp_path_factory):
    mild, strong = sorted(perturbed_dirs)  # noise scales, small then large
    report = tmp_path_factory.mktemp("fid_perturbed")
    cands = {"mild": perturbed_dirs[mild], "strong": perturbed_dirs[strong]}
    return _run(trained_dir, cands, report, FidelityConfig(max_kl=1e-3)), report


def test_identical_model_scores_perfectly(trained_dir, tmp_path):
    result = _run(trained_dir, {"same": trained_dir}, tmp_path)
    m = result.candidates["same"]["metrics"]
    assert m["kl"]["max"] <= 1e-6 and m["kl"]["mean"] <= 1e-6
    assert m["top1"] == 1.0
    assert m["ppl_ratio"] == pytest.approx(1.0, abs=1e-9)
    assert abs(m["p_top_delta"]) < 1e-9
    assert m["tokens"] == 3 * 48 and m["tokens_scored"] == 3 * 47 == result.dense["tokens_scored"]
    layers = result.candidates["same"]["per_layer"]
    assert len(layers) == 3
    assert all(r["rel_error"] < 1e-6 and r["cosine"] == pytest.approx(1.0, abs=1e-6) for r in layers)
    assert result.passed and result.gates == []
    assert result.candidates["same"]["sha256"] == result.dense["sha256"]  # same directory, same hash
    _validate(tmp_path)


def test_perturbation_moves_every_metric_the_right_way(perturbed_result):
    result, _ = perturbed_result
    mild, strong = (result.candidates[k]["metrics"] for k in ("mild", "strong"))
    assert 0 < mild["kl"]["mean"] < strong["kl"]["mean"]
    assert mild["kl"]["median"] <= mild["kl"]["p99"] <= mild["kl"]["max"]
    assert strong["top1"] < mild["top1"] < 1.0
    assert strong["p_top_delta"] < mild["p_top_delta"] < 0
    assert 1.0 < mild["ppl_ratio"] < strong["ppl_ratio"]
    lm, ls = result.candidates["mild"]["per_layer"], result.candidates["strong"]["per_layer"]
    for a, b in zip(lm, ls):
        assert 0 < a["rel_error"] < b["rel_error"]
        assert b["cosine"] < a["cosine"] < 1.0


def test_numbers_agree_with_an_independent_computation(perturbed_result, trained_dir, perturbed_dirs, bpe_tokenizer):
    """Recompute KL, top-1 and perplexities straight from transformers on the same windows."""
    from transformers import AutoModelForCausalLM

    from laco_deploy.data import evaluation_windows

    result, _ = perturbed_result
    ids = evaluation_windows(bpe_tokenizer, "builtin", DATA.eval_samples, DATA.seqlen)
    load = lambda p: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()
    with torch.no_grad():
        dense_out, cand_out = load(trained_dir)(ids, labels=ids), load(perturbed_dirs[max(perturbed_dirs)])(ids, labels=ids)
    logp, logq = dense_out.logits.double().log_softmax(-1), cand_out.logits.double().log_softmax(-1)
    kl = torch.nn.functional.kl_div(logq, logp, log_target=True, reduction="none").sum(-1)
    m = result.candidates["strong"]["metrics"]
    assert m["kl"]["mean"] == pytest.approx(kl.mean().item(), rel=1e-4)
    assert m["kl"]["max"] == pytest.approx(kl.max().item(), rel=1e-4)
    assert m["top1"] == pytest.approx((logp.argmax(-1) == logq.argmax(-1)).double().mean().item())
    assert result.dense["ppl"] == pytest.approx(dense_out.loss.exp().item(), rel=1e-4)
    assert m["ppl"] == pytest.approx(cand_out.loss.exp().item(), rel=1e-4)


def test_failed_gate_is_recorded_and_reports_are_written(perturbed_result):
    result, report = perturbed_result
    assert not result.passed
    assert {g["candidate"] for g in result.gates if not g["passed"]} == {"mild", "strong"}
    gate = next(g for g in result.gates if g["candidate"] == "strong")
    assert gate["miss"] == pytest.approx(result.candidates["strong"]["metrics"]["kl"]["mean"] - 1e-3)
    doc = _validate(report)
    assert doc["passed"] is False and doc["settings"]["tokens_sha256"] == result.settings["tokens_sha256"]
    assert {"torch", "transformers", "python", "laco_deploy"} <= set(doc["versions"])
    assert re.fullmatch(r"[0-9a-f]{64}", doc["candidates"]["strong"]["sha256"])
    md = (report / "fidelity.md").read_text()
    assert "| strong | pytorch |" in md and "FAIL: max_kl" in md and "KL p99" in md
    assert "**gate max_kl FAILED by" in md
    from laco_deploy.fidelity.report import markdown

    assert markdown(doc) == md  # reports re-render from the saved JSON


def test_schema_catches_a_broken_report(perturbed_result):
    _, report = perturbed_result
    doc = json.loads((report / "fidelity.json").read_text())
    schema = _schema()
    broken = dict(doc)
    del broken["passed"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)
    doc["candidates"]["mild"]["metrics"]["top1"] = 1.5
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, schema)


def test_html_is_self_contained_with_embedded_figures(perturbed_result):
    _, report = perturbed_result
    page = (report / "fidelity.html").read_text()
    assert not re.search(r"https?://", page)
    assert "<script" not in page and "<link" not in page and "url(" not in page and "@import" not in page
    images = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(images) == 2  # per-layer curves and KL distribution
    assert all(base64.b64decode(img)[:8] == b"\x89PNG\r\n\x1a\n" for img in images)
    assert len(re.findall(r"<img ", page)) == 2 and "strong" in page


class _FakeRuntime:
    """Stands in for onnxruntime / llama.cpp: the dense model's logits, transformed."""

    name = "onnxruntime"

    def __init__(self, model, transform):
        self.model, self.transform = model, transform

    def logits(self, input_ids):
        with torch.no_grad():
            return self.transform(self.model(input_ids.view(1, -1), use_cache=False).logits[0].float())


def _patch_runner(monkeypatch, trained_dir, transform):
    from laco_deploy.runtimes.runner import open_runner as real_open

    def fake_open(path, device="cpu", threads=None, **_kw):
        if str(path).endswith(".onnx"):
            return _FakeRuntime(real_open(trained_dir).model, transform)
        return real_open(path, device=device, threads=threads)

    monkeypatch.setattr(fid_eval, "open_runner", fake_open)


def test_runtime_candidate_temperature_keeps_top1_and_has_no_layer_curves(monkeypatch, trained_dir, tmp_path):
    _patch_runner(monkeypatch, trained_dir, lambda x: x / 2)  # temperature 2: same argmax, flatter
    fake = tmp_path / "model.onnx"
    fake.write_bytes(b"stand-in")
    result = _run(trained_dir, {"ort": fake, "torch": trained_dir}, tmp_path / "r", FidelityConfig(min_top1=0.99))
    c = result.candidates["ort"]
    assert c["runtime"] == "onnxruntime" and c["per_layer"] is None
    assert c["metrics"]["top1"] == 1.0 and c["metrics"]["kl"]["mean"] > 1e-3 and c["metrics"]["p_top_delta"] < 0
    assert result.candidates["torch"]["per_layer"] is not None
    assert result.passed
    _validate(tmp_path / "r")


@pytest.mark.parametrize("transform, error, words", [
    (lambda x: x[:, :-1], ModelError, "vocabulary"),
    (lambda x: x * float("nan"), RuntimeBackendError, "NaN"),
])
def test_broken_runtime_candidate_is_a_clear_error(monkeypatch, trained_dir, tmp_path, transform, error, words):
    _patch_runner(monkeypatch, trained_dir, transform)
    fake = tmp_path / "model.onnx"
    fake.write_bytes(b"stand-in")
    with pytest.raises(error, match=words):
        _run(trained_dir, {"bad": fake}, tmp_path / "r")


def test_other_depth_candidate_gets_a_note_instead_of_curves(trained_dir, tiny_llama_dir, tmp_path):
    result = _run(trained_dir, {"two_layers": tiny_llama_dir}, tmp_path)
    assert result.candidates["two_layers"]["per_layer"] is None
    assert any("two_layers" in n and "per-layer" in n for n in result.notes)
    assert "No PyTorch candidate" in (tmp_path / "fidelity.html").read_text()


def test_every_domain_reported_side_by_side(trained_dir, perturbed_dirs, tmp_path):
    """The default evaluation covers the in-domain builtin text and each shipped out-of-domain text;
    per-domain sums add up to the pooled numbers, and the reports show one column group per domain."""
    data = DataConfig(eval="domains", eval_samples=2, seqlen=48)
    strong = perturbed_dirs[max(perturbed_dirs)]
    result = run(ModelConfig(model=str(trained_dir), device="cpu"), data, FidelityConfig(), {"strong": strong}, tmp_path)
    domains = [d["label"] for d in result.settings["domains"]]
    assert domains[0] == "wikipedia" and {"fiction", "techdoc", "code"} <= set(domains)
    genres = {"wikipedia", "code"}  # the default calibration, builtin:mixed, covers these two genres
    assert [d["in_domain"] for d in result.settings["domains"]] == [d in genres for d in domains]
    per = result.candidates["strong"]["domains"]
    assert set(per) == set(domains) == set(result.dense["domains"])
    assert sum(m["tokens_scored"] for m in per.values()) == result.candidates["strong"]["metrics"]["tokens_scored"]
    pooled_nll = sum(math.log(m["ppl"]) * m["tokens_scored"] for m in per.values()) / sum(m["tokens_scored"] for m in per.values())
    assert math.exp(pooled_nll) == pytest.approx(result.candidates["strong"]["metrics"]["ppl"], rel=1e-9)
    assert per["wikipedia"]["ppl_ratio"] > 1.0 and all(m["kl_mean"] > 0 for m in per.values())
    assert len({round(m["ppl"], 6) for m in per.values()}) == len(per)  # distinct texts, distinct numbers
    md = (tmp_path / "fidelity.md").read_text()
    assert "fiction (out-of-domain) ppl" in md and "wikipedia (in-domain) ppl" in md
    assert "Per evaluation domain" in (tmp_path / "fidelity.html").read_text()
    _validate(tmp_path)


def test_domain_texts_are_never_calibration():
    from laco_deploy.data import load_texts
    from laco_deploy.errors import DataError

    with pytest.raises(DataError, match="evaluation-only"):
        load_texts("builtin:fiction", "calib")
    with pytest.raises(DataError, match="no builtin text 'poetry'"):
        load_texts("builtin:poetry", "eval")
