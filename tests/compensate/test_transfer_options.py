"""LaCo training options aimed at transfer (issue 15): anchor decay towards the pruned weights and
dense-path input mixing. Each keeps the mask, lowers the layer error and resumes exactly."""

from __future__ import annotations

import pytest
import torch
from test_laco import DATA, _assert_same_pattern, _cfg, _Killed, _weights

from laco_deploy.compensate import laco, run
from laco_deploy.config import ModelConfig

OPTIONS = {"anchor": {"anchor_decay": 50.0}, "dense_mix": {"dense_input_mix": 0.5}}


@pytest.mark.parametrize("option", list(OPTIONS))
def test_option_keeps_mask_and_lowers_error(tiny_llama_dir, sparse_unstructured_dir, tmp_path, option):
    res = run(ModelConfig(model=str(tiny_llama_dir)), DATA, _cfg(epochs=3, **OPTIONS[option]),
              sparse_unstructured_dir, tmp_path / "out")
    _assert_same_pattern(sparse_unstructured_dir, tmp_path / "out")
    for rec in res.per_layer:
        assert rec["nmse_after"] < rec["nmse_before"]
        assert rec["train_gflop"] > 0


@pytest.mark.parametrize("option", list(OPTIONS))
def test_option_resume_equals_uninterrupted(tiny_llama_dir, sparse_unstructured_dir, tmp_path, monkeypatch, option):
    mcfg, ccfg = ModelConfig(model=str(tiny_llama_dir)), _cfg(epochs=2, **OPTIONS[option])
    run(mcfg, DATA, ccfg, sparse_unstructured_dir, tmp_path / "full")
    real_fit = laco.LayerTrainer.fit

    def fit_then_die(self, *a, **kw):
        if self.seed == DATA.seed + 1:
            raise _Killed("simulated kill")
        return real_fit(self, *a, **kw)

    monkeypatch.setattr(laco.LayerTrainer, "fit", fit_then_die)
    with pytest.raises(_Killed):
        run(mcfg, DATA, ccfg, sparse_unstructured_dir, tmp_path / "resumed")
    monkeypatch.setattr(laco.LayerTrainer, "fit", real_fit)
    run(mcfg, DATA, ccfg, sparse_unstructured_dir, tmp_path / "resumed", resume=True)
    full, resumed = _weights(tmp_path / "full"), _weights(tmp_path / "resumed")
    assert all(torch.equal(full[k], resumed[k]) for k in full)


def _distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return sum(float((a[k] - b[k]).norm()) for k in a if k.endswith("proj.weight"))


def test_anchor_decay_keeps_weights_closer_to_pruned(tiny_llama_dir, sparse_unstructured_dir, tmp_path):
    mcfg = ModelConfig(model=str(tiny_llama_dir))
    run(mcfg, DATA, _cfg(epochs=3, val_fraction=0.0), sparse_unstructured_dir, tmp_path / "free")
    run(mcfg, DATA, _cfg(epochs=3, val_fraction=0.0, anchor_decay=200.0), sparse_unstructured_dir, tmp_path / "anchored")
    pruned = _weights(sparse_unstructured_dir)
    free, anchored = _distance(_weights(tmp_path / "free"), pruned), _distance(_weights(tmp_path / "anchored"), pruned)
    assert 0 < anchored < 0.8 * free


def test_invalid_option_values_are_reported():
    errs = _cfg(anchor_decay=-1.0, dense_input_mix=1.5).validate()
    assert any("anchor" in e for e in errs) and any("dense" in e for e in errs)


@pytest.mark.parametrize("method", ["laco", "lora"])
def test_throughput_reported_against_matmul(tiny_llama_dir, sparse_unstructured_dir, tmp_path, method):
    res = run(ModelConfig(model=str(tiny_llama_dir)), DATA, _cfg(epochs=1, method=method), sparse_unstructured_dir,
              tmp_path / "out")
    speed = res.settings["throughput"]
    assert speed["gflop"] > 0 and speed["matmul_gflops"] > 0
    assert speed["achieved_gflops"] == pytest.approx(speed["gflop"] / speed["seconds"], rel=0.02)
    assert any("GFLOP/s" in n and "matmul" in n for n in res.notes)


def test_training_flops_match_the_layer_shapes(tiny_llama_dir, sparse_unstructured_dir, tmp_path):
    """Forward (2 x params x tokens) plus backward (weight grads, and input grads for all but the
    first projections) is between 2x and 3x the forward count; attention adds a little."""
    res = run(ModelConfig(model=str(tiny_llama_dir)), DATA, _cfg(epochs=1, val_fraction=0.0), sparse_unstructured_dir,
              tmp_path / "out")
    weights = _weights(sparse_unstructured_dir)
    per_layer = sum(w.numel() for k, w in weights.items() if k.startswith("model.layers.0.") and k.endswith("proj.weight"))
    tokens = DATA.samples * DATA.seqlen
    forward = 2 * per_layer * tokens / 1e9
    assert 2 * forward <= res.per_layer[0]["train_gflop"] <= 3.5 * forward


def test_lsq_init_keeps_mask_and_never_worsens(tiny_llama_dir, sparse_unstructured_dir, tmp_path):
    res = run(ModelConfig(model=str(tiny_llama_dir)), DATA, _cfg(epochs=2, init="lsq"), sparse_unstructured_dir,
              tmp_path / "out")
    _assert_same_pattern(sparse_unstructured_dir, tmp_path / "out")
    _lowered(res.per_layer)


def _lowered(records: list[dict]) -> None:
    """The refit (and training) never leaves a layer worse than pruned on held-out samples."""
    assert all(r["nmse_after"] <= r["nmse_pruned"] for r in records)


def test_masked_ridge_rows_equal_per_row_least_squares():
    from laco_deploy.compensate.lsq import _solve_rows

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(300, 10, generator=gen, dtype=torch.float64)
    y = x @ torch.randn(10, 4, generator=gen, dtype=torch.float64)
    w0 = torch.randn(4, 10, generator=gen, dtype=torch.float64)
    ragged = torch.rand(4, 10, generator=gen) > 0.5
    per_row = torch.stack([torch.randperm(10, generator=gen) < 5 for _ in range(4)])  # 5 kept in every row
    for mask in (ragged, per_row):
        w = _solve_rows(x.T @ x, x.T @ y, w0, mask, damp=1e-9)
        for i in range(4):
            keep = mask[i].nonzero().squeeze(1)
            ref = torch.linalg.lstsq(x[:, keep], y[:, i]).solution
            assert torch.allclose(w[i, keep].double(), ref, atol=1e-4)
            assert (w[i, ~mask[i]] == 0).all()


def test_lsq_refit_lowers_the_layer_error_on_its_samples(tiny_llama_dir, sparse_unstructured_dir):
    """On the samples it is fit on, the refit of layer 0 (same input on both paths) lowers the error."""
    from laco_deploy.compensate import lsq
    from laco_deploy.compensate.masks import layer_masks
    from laco_deploy.data import calibration_samples
    from laco_deploy.engine import LayerContext, capture_layer_inputs
    from laco_deploy.engine.capture import kwargs_on
    from laco_deploy.models import load_model

    dense, sparse = load_model(str(tiny_llama_dir)), load_model(str(sparse_unstructured_dir))
    for m in (dense.model, sparse.model):
        m.requires_grad_(False)
    cpu = torch.device("cpu")
    inputs = capture_layer_inputs(sparse.model, calibration_samples(sparse.tokenizer, "builtin", 8, 32, 0), cpu)
    layer, twin = sparse.model.model.layers[0], dense.model.model.layers[0]
    targets = inputs.hidden.clone_empty()
    ctx = LayerContext(0, 2, layer, inputs.hidden, kwargs_on(inputs.kwargs, cpu), cpu, 4, twin, inputs.hidden, targets)
    ctx.run(twin, inputs.hidden, targets)
    error = lambda: float((ctx.forward(layer, inputs.hidden.data) - targets.data).pow(2).sum())  # noqa: E731
    before = error()
    masks = layer_masks(layer)
    lsq.refit_layer(ctx, masks, torch.arange(8), damp=1e-3)
    assert error() < 0.8 * before
    assert all(torch.equal(layer_masks(layer)[k], masks[k]) for k in masks)


def test_lsq_refit_on_structured_and_qwen2_biases(tiny_llama_dir, sparse_structured_dir, tiny_qwen2_dir, tmp_path):
    from compensate_sparse import make_unstructured

    res = run(ModelConfig(model=str(tiny_llama_dir)), DATA, _cfg(epochs=0, init="lsq"), sparse_structured_dir,
              tmp_path / "structured")
    _lowered(res.per_layer)
    sparse = make_unstructured(tiny_qwen2_dir, tmp_path / "qwen_sparse")
    res = run(ModelConfig(model=str(tiny_qwen2_dir)), DATA, _cfg(epochs=0, init="lsq"), sparse, tmp_path / "qwen")
    # the guard may keep the pruned weights of a layer (held-out loss rose): then nothing has to change
    _assert_same_pattern(sparse, tmp_path / "qwen", require_change=any(r["refit_kept"] for r in res.per_layer))
    _lowered(res.per_layer)
