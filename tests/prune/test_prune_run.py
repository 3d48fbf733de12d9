"""The prune stage end to end on tiny models: output directory, masks, sparse path, resume, errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from laco_deploy.config import DataConfig, ModelConfig, PruneConfig
from laco_deploy.errors import ConfigError, DataError
from laco_deploy.models import load_model
from laco_deploy.prune import checkpoint_dir, run, scoring, step


def _run(data, src, out, **prune):
    return run(ModelConfig(model=str(src)), data, PruneConfig(**prune), out)


def _weights(path) -> dict[str, torch.Tensor]:
    """All tensors of a saved model (one file or shards)."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize("method", ["magnitude", "wanda", "sparsegpt"])
def test_unstructured_every_row_at_ratio(data_cfg, tiny_llama_dir, tmp_path, method):
    out = tmp_path / method
    result = _run(data_cfg, tiny_llama_dir, out, method=method, sparsity=0.5)
    assert result.sparsity == pytest.approx(0.5) and result.stage == "prune"
    assert result.peak_mib > 0 and result.wall_s > 0
    w, dense = _weights(out), _weights(tiny_llama_dir)
    for name, t in w.items():
        if any(p in name for p in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")):
            assert ((t == 0).sum(1) == t.shape[1] // 2).all(), name
        else:  # embeddings, norms (and the tied head) are untouched
            assert torch.equal(t, dense[name]), name
    cfg = json.loads((out / "config.json").read_text())["laco_deploy"]
    assert cfg["stage"] == "prune" and cfg["method"] == method and cfg["pattern"] == "unstructured"
    assert cfg["sparsity"] == pytest.approx(0.5)
    doc = json.loads((out / "sparsity.json").read_text())
    assert len(doc["matrices"]) == 14 and all(m["sparsity"] == 0.5 for m in doc["matrices"].values())
    assert [r["layer"] for r in doc["per_layer"]] == [0, 1] and all("seconds" in r for r in doc["per_layer"])
    assert doc["settings"]["method"] == method
    assert not checkpoint_dir(out).exists()
    loaded = load_model(str(out)).model
    assert torch.isfinite(loaded(torch.randint(0, 500, (1, 8))).logits).all()


@pytest.mark.parametrize("method,pattern", [("wanda", "2:4"), ("sparsegpt", "2:4"), ("magnitude", "4:8")])
def test_nm_every_group_at_most_n(data_cfg, tiny_qwen2_dir, tmp_path, method, pattern):
    n, m = (int(x) for x in pattern.split(":"))
    out = tmp_path / "nm"
    result = _run(data_cfg, tiny_qwen2_dir, out, method=method, pattern=pattern)
    assert result.pattern == pattern and result.sparsity == pytest.approx((m - n) / m)
    for name, t in _weights(out).items():
        if name.endswith("proj.weight"):
            assert ((t != 0).view(t.shape[0], -1, m).sum(2) <= n).all(), name


def test_targets_limit_what_is_pruned(data_cfg, tiny_llama_untied_dir, tmp_path):
    out = tmp_path / "mlp_only"
    _run(data_cfg, tiny_llama_untied_dir, out, targets=("gate_proj", "up_proj", "down_proj"))
    w, dense = _weights(out), _weights(tiny_llama_untied_dir)
    assert torch.equal(w["model.layers.0.self_attn.q_proj.weight"], dense["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(w["lm_head.weight"], dense["lm_head.weight"])
    assert (w["model.layers.1.mlp.down_proj.weight"] == 0).float().mean() == 0.5


def test_second_layer_is_scored_on_the_pruned_first_layer_outputs(data_cfg, tiny_llama_dir, tmp_path):
    """Wanda's layer-1 mask must come from the inputs produced by the *pruned* layer 0 (sparse path)."""
    out = tmp_path / "wanda"
    _run(data_cfg, tiny_llama_dir, out, method="wanda", sparsity=0.5)
    pruned = load_model(str(out)).model
    dense = load_model(str(tiny_llama_dir)).model
    from laco_deploy.data import calibration_samples

    ids = calibration_samples(load_model(str(tiny_llama_dir)).tokenizer, data_cfg.calib, 4, 32, 0)
    captured = {}

    def grab(model):
        handle = model.model.layers[1].self_attn.q_proj.register_forward_hook(
            lambda _m, a, _o: captured.setdefault(id(model), []).append(a[0].reshape(-1, a[0].shape[-1])))
        with torch.no_grad():
            for row in ids:
                model(row.unsqueeze(0))
        handle.remove()
        return torch.cat(captured[id(model)]).pow(2).sum(0)

    # q_proj of layer 1 sees only the output of layer 0 (through the layer-1 input norm)
    sq_sparse, sq_dense = grab(pruned), grab(dense)
    w = dense.model.layers[1].self_attn.q_proj.weight.detach()
    got = pruned.model.layers[1].self_attn.q_proj.weight == 0
    assert torch.equal(got, scoring.row_mask(scoring.wanda_scores(w, sq_sparse), 0.5))
    assert not torch.equal(got, scoring.row_mask(scoring.wanda_scores(w, sq_dense), 0.5))


@pytest.mark.parametrize("prune", [dict(method="sparsegpt", sparsity=0.5), dict(method="wanda", owl=True),
                                   dict(structured=0.3), dict(method="sparsegpt", pattern="2:4", offload="disk")])
def test_resume_equals_uninterrupted(data_cfg, tiny_llama_dir, tmp_path, monkeypatch, prune):
    ref = tmp_path / "ref"
    _run(data_cfg, tiny_llama_dir, ref, **prune)
    out = tmp_path / "resumed"
    real_dense, real_struct = step.prune_layer, __import__("laco_deploy.prune.structural", fromlist=["x"]).prune_layer_structured

    def killer(real):
        def fn(ctx, *args):
            if ctx.index == 1:
                raise KeyboardInterrupt("simulated kill after layer 0")
            return real(ctx, *args)
        return fn

    monkeypatch.setattr(step, "prune_layer", killer(real_dense))
    monkeypatch.setattr("laco_deploy.prune.structural.prune_layer_structured", killer(real_struct))
    with pytest.raises(KeyboardInterrupt):
        _run(data_cfg, tiny_llama_dir, out, **prune)
    assert not out.exists()
    assert (checkpoint_dir(out) / "layer_000.safetensors").is_file()
    assert not (checkpoint_dir(out) / "layer_001.safetensors").exists()
    monkeypatch.undo()
    calls = []
    monkeypatch.setattr(step, "prune_layer", lambda ctx, *a: calls.append(ctx.index) or real_dense(ctx, *a))
    monkeypatch.setattr("laco_deploy.prune.structural.prune_layer_structured",
                        lambda ctx, *a: calls.append(ctx.index) or real_struct(ctx, *a))
    run(ModelConfig(model=str(tiny_llama_dir)), data_cfg, PruneConfig(**prune), out, resume=True)
    assert calls == [1]  # layer 0 came from its checkpoint
    a, b = _weights(ref), _weights(out)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert not checkpoint_dir(out).exists()
    assert json.loads((out / "config.json").read_text())["laco_deploy"] == json.loads((ref / "config.json").read_text())["laco_deploy"]


def test_resume_with_other_settings_is_refused(data_cfg, tiny_llama_dir, tmp_path, monkeypatch):
    out = tmp_path / "o"
    monkeypatch.setattr(step, "prune_layer", lambda ctx, *a: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError):
        _run(data_cfg, tiny_llama_dir, out, sparsity=0.5)
    monkeypatch.undo()
    with pytest.raises(ConfigError, match="other settings"):
        run(ModelConfig(model=str(tiny_llama_dir)), data_cfg, PruneConfig(sparsity=0.6), out, resume=True)


@pytest.mark.parametrize("prune", [dict(method="wanda"), dict(method="sparsegpt", owl=True), dict(structured=0.3)])
def test_disk_offload_gives_the_same_weights(data_cfg, tiny_llama_untied_dir, tmp_path, prune):
    """--offload disk streams layers from safetensors and writes shards; the weights are the same."""
    _run(data_cfg, tiny_llama_untied_dir, tmp_path / "cpu", **prune)
    _run(data_cfg, tiny_llama_untied_dir, tmp_path / "disk", offload="disk", **prune)
    assert (tmp_path / "disk" / "model.safetensors.index.json").is_file()
    a, b = load_model(str(tmp_path / "cpu")).model.state_dict(), load_model(str(tmp_path / "disk")).model.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    doc_a, doc_b = (json.loads((tmp_path / d / "sparsity.json").read_text()) for d in ("cpu", "disk"))
    assert doc_a["matrices"] == doc_b["matrices"]


@pytest.mark.parametrize("prune,message", [
    (dict(sparsity=1.0), r"prune.sparsity 1.0 must be in \[0, 1\)"),
    (dict(sparsity=-0.1), r"prune.sparsity -0.1 must be in \[0, 1\)"),
    (dict(pattern="4:4"), r"need 0 < N < M"),
    (dict(pattern="2-4"), r"must look like N:M"),
    (dict(structured=1.0), r"prune.structured 1.0 must be in \(0, 1\)"),
    (dict(method="obc"), r"prune.method 'obc' is not one of"),
    (dict(targets=("lm_head",)), r"prune.targets lm_head unknown"),
    (dict(owl=True, pattern="2:4"), r"prune.owl sets per-layer ratios"),
])
def test_bad_settings_raise_one_clear_error(data_cfg, tiny_llama_dir, tmp_path, prune, message):
    with pytest.raises(ConfigError, match=message):
        _run(data_cfg, tiny_llama_dir, tmp_path / "x", **prune)


def test_short_calibration_text_is_a_data_error(tiny_llama_dir, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("just a few words\n")
    with pytest.raises(DataError, match="fewer than one sample"):
        run(ModelConfig(model=str(tiny_llama_dir)), DataConfig(calib=str(short), samples=4, seqlen=32), PruneConfig(),
            tmp_path / "x")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    with pytest.raises(DataError, match="holds no text"):
        run(ModelConfig(model=str(tiny_llama_dir)), DataConfig(calib=str(empty), samples=4, seqlen=32), PruneConfig(),
            tmp_path / "x")
