"""Pipeline mechanics: stage reuse, reruns on changed inputs/settings/outputs, manifest, interrupts, gates."""

from __future__ import annotations

import json

import pytest

from laco_deploy.config import BuildConfig, ModelConfig
from laco_deploy.errors import GateFailed
from laco_deploy.pipeline import prepare


def _cache(tmp_path):
    """The stage cache of a build folder, as a new process would open it."""
    return prepare(BuildConfig(model=ModelConfig(device="cpu"), out=str(tmp_path / "build"))).cache


def _writer(path, text, calls):
    def run():
        calls.append(text)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return {"wrote": text}
    return run


def test_stage_reused_when_unchanged(tmp_path):
    c = _cache(tmp_path)
    out = c.root / "a.txt"
    calls: list[str] = []
    r1 = c.run("prune", {"s": 1}, {"in": c.source("in", "h1")}, {"a": out}, _writer(out, "one", calls))
    c2 = _cache(tmp_path)  # a new process reading the manifest
    r2 = c2.run("prune", {"s": 1}, {"in": c2.source("in", "h1")}, {"a": out}, _writer(out, "two", calls))
    assert calls == ["one"] and r2.record["reused"] and r2.record["key"] == r1.record["key"]
    assert r2.outputs["a"].path == out and r2.outputs["a"].stage == "prune"
    manifest = json.loads(c.manifest_path.read_text())
    assert manifest["stages"]["prune"]["files"]["a"]["path"] == "a.txt"
    assert len(manifest["stages"]["prune"]["files"]["a"]["sha256"]) == 64


@pytest.mark.parametrize("change", ["settings", "inputs", "tamper", "delete"])
def test_stage_rerun_when_something_changed(tmp_path, change):
    c = _cache(tmp_path)
    out = c.root / "a.txt"
    calls: list[str] = []
    c.run("prune", {"s": 1}, {"in": c.source("in", "h1")}, {"a": out}, _writer(out, "one", calls))
    settings, fingerprint = {"s": 1}, "h1"
    if change == "settings":
        settings = {"s": 2}
    elif change == "inputs":
        fingerprint = "h2"
    elif change == "tamper":
        out.write_text("edited by hand")
    else:
        out.unlink()
    c2 = _cache(tmp_path)
    r = c2.run("prune", settings, {"in": c2.source("in", fingerprint)}, {"a": out}, _writer(out, "two", calls))
    assert calls == ["one", "two"] and not r.record["reused"]


def test_interrupted_stage_is_not_recorded(tmp_path):
    c = _cache(tmp_path)
    out = c.root / "a.txt"

    def killed():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        c.run("prune", {}, {}, {"a": out}, killed)
    assert "prune" not in c.manifest["stages"]
    calls: list[str] = []
    r = _cache(tmp_path).run("prune", {}, {}, {"a": out}, _writer(out, "one", calls))
    assert calls == ["one"] and not r.record["reused"]


def test_manifest_records_versions_and_measurements(tmp_path):
    c = _cache(tmp_path)
    out = c.root / "a.txt"
    r = c.run("prune", {}, {}, {"a": out}, _writer(out, "x", [])).record
    m = json.loads(c.manifest_path.read_text())
    assert m["versions"]["torch"] and m["device"] == "cpu" and m["seed"] == 0
    assert r["wall_s"] >= 0 and r["peak_mib"] > 0 and r["result"] == {"wrote": "x"}
    assert 0 < r["start_mib"] <= r["peak_mib"]


def test_key_follows_the_named_outputs_of_earlier_stages(tmp_path):
    """A stage names its inputs as earlier outputs; the cache reads their hashes, so a changed
    upstream output reruns the stage that uses it."""
    c = _cache(tmp_path)
    a, b = c.root / "a.txt", c.root / "b.txt"
    calls: list[str] = []
    first = c.run("prune", {}, {}, {"a": a}, _writer(a, "one", calls)).outputs["a"]
    c.run("export", {}, {"a": first}, {"b": b}, _writer(b, "b", calls))
    assert c.manifest["stages"]["export"]["inputs"] == {"a": c.manifest["stages"]["prune"]["files"]["a"]["sha256"]}
    c2 = _cache(tmp_path)
    changed = c2.run("prune", {"s": 2}, {}, {"a": a}, _writer(a, "two", calls)).outputs["a"]
    r = c2.run("export", {}, {"a": changed}, {"b": b}, _writer(b, "b", calls))
    assert calls == ["one", "b", "two", "b"] and not r.record["reused"]
    with pytest.raises(KeyError, match="no output 'x'"):
        c2.run("bench", {}, {"x": type(changed)("prune", "x")}, {}, lambda: None)


def test_missing_gate_verdict_is_an_error_not_a_pass():
    from laco_deploy.fidelity.gates import verdict
    from laco_deploy.summary import summarize

    assert verdict({"passed": False}) is False and verdict({"passed": True}) is True
    with pytest.raises(GateFailed, match="no gate verdict"):
        verdict({"gates": []})
    with pytest.raises(GateFailed, match="no gate verdict"):
        summarize({"stages": {"fidelity": {"result": {"candidates": {}, "gates": []}}}})
