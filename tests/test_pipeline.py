"""Pipeline mechanics: stage reuse, reruns on changed inputs/settings/outputs, manifest, interrupts."""

from __future__ import annotations

import json

import pytest

from laco_deploy.config import BuildConfig, ModelConfig
from laco_deploy.pipeline import Builder


def _builder(tmp_path):
    return Builder(BuildConfig(model=ModelConfig(device="cpu"), out=str(tmp_path / "build")))


def _writer(path, text, calls):
    def run():
        calls.append(text)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return {"wrote": text}
    return run


def test_stage_reused_when_unchanged(tmp_path):
    b = _builder(tmp_path)
    out = b.layout.root / "a.txt"
    calls: list[str] = []
    r1 = b.stage("prune", {"s": 1}, {"in": "h1"}, {"a": out}, _writer(out, "one", calls))
    b2 = _builder(tmp_path)  # a new process reading the manifest
    r2 = b2.stage("prune", {"s": 1}, {"in": "h1"}, {"a": out}, _writer(out, "two", calls))
    assert calls == ["one"] and r2["reused"] and r2["key"] == r1["key"]
    manifest = json.loads(b.layout.manifest.read_text())
    assert manifest["stages"]["prune"]["files"]["a"]["path"] == "a.txt"
    assert len(manifest["stages"]["prune"]["files"]["a"]["sha256"]) == 64


@pytest.mark.parametrize("change", ["settings", "inputs", "tamper", "delete"])
def test_stage_rerun_when_something_changed(tmp_path, change):
    b = _builder(tmp_path)
    out = b.layout.root / "a.txt"
    calls: list[str] = []
    b.stage("prune", {"s": 1}, {"in": "h1"}, {"a": out}, _writer(out, "one", calls))
    settings, inputs = {"s": 1}, {"in": "h1"}
    if change == "settings":
        settings = {"s": 2}
    elif change == "inputs":
        inputs = {"in": "h2"}
    elif change == "tamper":
        out.write_text("edited by hand")
    else:
        out.unlink()
    r = _builder(tmp_path).stage("prune", settings, inputs, {"a": out}, _writer(out, "two", calls))
    assert calls == ["one", "two"] and not r["reused"]


def test_interrupted_stage_is_not_recorded(tmp_path):
    b = _builder(tmp_path)
    out = b.layout.root / "a.txt"

    def killed():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        b.stage("prune", {}, {}, {"a": out}, killed)
    assert "prune" not in b.manifest["stages"]
    calls: list[str] = []
    r = _builder(tmp_path).stage("prune", {}, {}, {"a": out}, _writer(out, "one", calls))
    assert calls == ["one"] and not r["reused"]


def test_manifest_records_versions_and_measurements(tmp_path):
    b = _builder(tmp_path)
    out = b.layout.root / "a.txt"
    r = b.stage("prune", {}, {}, {"a": out}, _writer(out, "x", []))
    m = json.loads(b.layout.manifest.read_text())
    assert m["versions"]["torch"] and m["device"] == "cpu" and m["seed"] == 0
    assert r["wall_s"] >= 0 and r["peak_mib"] > 0 and r["result"] == {"wrote": "x"}
