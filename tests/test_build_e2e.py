"""The whole chain on a tiny model: complete output folder, reuse on rerun, resume after a kill."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from laco_deploy.buildconfig import merge
from laco_deploy.pipeline import build

SMALL = {
    "data": {"samples": 6, "seqlen": 32, "eval_samples": 2},
    "compensate": {"epochs": 1},
    "bench": {"repetitions": 1, "n_prompt": 16, "n_gen": 4, "ppl_ctx": 32, "ppl_windows": 1},
}


def _cfg(model_dir, out, **extra):
    values = {k: dict(v) for k, v in SMALL.items()}
    values["model"] = {"model": str(model_dir), "device": "cpu"}
    for dotted, v in extra.items():
        section, _, key = dotted.partition("__")
        values.setdefault(section, {})[key] = v
    return merge(values, {"out": str(out)})


def _weights(d):
    return {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def test_gguf_build_complete_then_reused(tiny_llama_dir, tmp_path, monkeypatch):
    import laco_deploy.checked as boundary

    out = tmp_path / "build"
    user_files = [tmp_path / "neighbour.txt", tmp_path / ".build.old", tmp_path / "sub" / "deep.txt"]  # issue 28
    for f in user_files:
        f.parent.mkdir(exist_ok=True)
        f.write_text("the user's")
    calls = []
    for name in ("check_source", "check_texts", "resolve_device"):  # the boundary's checks, counted
        real = getattr(boundary, name)
        monkeypatch.setattr(boundary, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    manifest = build(_cfg(tiny_llama_dir, out))
    assert sorted(calls) == ["check_source", "check_texts", "check_texts", "resolve_device"]  # once per build
    for name in ("pruned/config.json", "recovered/config.json", "model.q8_0.gguf", "fidelity.json", "fidelity.md",
                 "fidelity.html", "bench.json", "manifest.json", "reference/dense.q8_0.gguf"):
        assert (out / name).exists(), name
    assert not list(out.rglob("*.partial")) and not list(out.parent.glob("*.ckpt"))
    on_disk = json.loads((out / "manifest.json").read_text())
    assert set(on_disk["stages"]) == {"prune", "compensate", "export", "fidelity", "bench"}
    for stage in on_disk["stages"].values():
        assert stage["files"] and all(len(f["sha256"]) == 64 for f in stage["files"].values())
        assert stage["wall_s"] >= 0 and stage["peak_mib"] > 0
    assert on_disk["inputs"]["model"] and on_disk["versions"]["llama-cpp-python"]
    s = manifest["summary"]
    assert s["sparsity"] == pytest.approx(0.5, abs=0.01)
    assert set(s["ppl_pytorch"]) >= {"dense", "pruned", "laco"} and s["ppl_runtime"]["laco"] > 1

    again = build(_cfg(tiny_llama_dir, out))
    assert all(st["reused"] for st in again["stages"].values())
    changed = build(_cfg(tiny_llama_dir, out, fidelity__min_top1=0.99, data__eval_samples=1))
    reused = {k for k, st in changed["stages"].items() if st["reused"]}
    assert reused == {"prune", "compensate", "export", "bench"}  # only fidelity depends on gates and eval budget
    assert changed["summary"]["gates_passed"] is False
    assert all(f.read_text() == "the user's" for f in user_files)  # three builds into the folder, nothing else touched
    assert sorted(p.name for p in tmp_path.iterdir()) == [".build.old", "build", "neighbour.txt", "sub"]


def _prune_and_compensate(cfg):
    """The first two stages exactly as build() runs them (the later ones do not matter here)."""
    from laco_deploy.pipeline import prepare

    recipe = prepare(cfg)
    src = recipe.sources()
    return recipe, recipe.compensate(src, recipe.prune(src)).path


def test_resume_after_kill_mid_compensation_equals_uninterrupted(tiny_llama_dir, tmp_path, monkeypatch):
    import laco_deploy.compensate.laco as laco

    _, reference = _prune_and_compensate(_cfg(tiny_llama_dir, tmp_path / "ref"))
    real_make_step = laco.make_step

    def make_killing_step(*args, **kwargs):
        step = real_make_step(*args, **kwargs)

        def killing(ctx):
            if ctx.index == 1:
                raise KeyboardInterrupt  # Ctrl-C after layer 0 was checkpointed
            return step(ctx)
        return killing

    out = tmp_path / "killed"
    monkeypatch.setattr(laco, "make_step", make_killing_step)
    with pytest.raises(KeyboardInterrupt):
        _prune_and_compensate(_cfg(tiny_llama_dir, out))
    assert not (out / "recovered").exists()  # no half-written model that looks complete
    assert json.loads((out / "manifest.json").read_text())["stages"].keys() == {"prune"}
    trained: list[int] = []

    def make_counting_step(*args, **kwargs):
        step = real_make_step(*args, **kwargs)
        return lambda ctx: (trained.append(ctx.index), step(ctx))[1]

    monkeypatch.setattr(laco, "make_step", make_counting_step)
    cfg = _cfg(tiny_llama_dir, out)
    b, recovered = _prune_and_compensate(merge({"model": {"model": str(tiny_llama_dir), "device": "cpu"}, **SMALL},
                                               {"out": str(out), "resume": True}))
    assert b.cache.manifest["stages"]["prune"]["reused"] and cfg.compensate == b.cfg.compensate
    assert trained == [1]  # layer 0 came from its checkpoint
    a, c = _weights(reference), _weights(recovered)
    assert a.keys() == c.keys() and all((a[k] == c[k]).all() for k in a)


def test_imatrix_build_weights_each_export_with_its_own_matrix(tiny_llama_dir, tmp_path):
    """export.imatrix calib: the dense and the pruned model each get the importance matrix of their own
    activations on the calibration samples; a file is refused (it cannot fit every exported model)."""
    from laco_deploy.errors import ConfigError
    from laco_deploy.pipeline import prepare

    out = tmp_path / "b"
    recipe = prepare(_cfg(tiny_llama_dir, out, export__quant="q4_k_m", export__imatrix="calib", compensate__method="none"))
    src = recipe.sources()
    pruned = recipe.prune(src)
    exported = recipe.export(src, pruned, pruned)
    assert set(exported) == {"dense", "model", "imatrix-dense", "imatrix-model"}
    result = recipe.cache.manifest["stages"]["export"]["result"]
    for label in ("dense", "model"):
        assert (out / "imatrix" / f"{label}.imatrix.gguf").is_file()
        assert any("14 weights importance-weighted" in n for n in result[label]["notes"]), result[label]["notes"]
    with pytest.raises(ConfigError, match="computes each exported model's own importance matrix"):
        _cfg(tiny_llama_dir, out, export__quant="q4_k_m", export__imatrix="m.gguf")


def test_imatrix_build_exports_a_qa_model_with_the_matrix_it_trained_through(tiny_llama_dir, tmp_path):
    """A model folder holding imatrix.gguf (QA-LaCo's compensate.quant_imatrix) is exported with that
    file, not one computed on it: llama.cpp then writes the grid the weights were trained through."""
    from laco_deploy.config import DataConfig
    from laco_deploy.imatrix import TRAINED_FILE, compute
    from laco_deploy.pipeline import prepare

    out = tmp_path / "b"
    recipe = prepare(_cfg(tiny_llama_dir, out, export__quant="q4_k_m", export__imatrix="calib", compensate__method="none"))
    src = recipe.sources()
    pruned = recipe.prune(src)
    trained = Path(pruned.path) / TRAINED_FILE
    compute(tiny_llama_dir, DataConfig(samples=2, seqlen=32, seed=5), trained)  # not what calib gives
    recipe.export(src, pruned, pruned)
    assert (out / "imatrix" / "model.imatrix.gguf").read_bytes() == trained.read_bytes()
    assert (out / "imatrix" / "dense.imatrix.gguf").read_bytes() != trained.read_bytes()
