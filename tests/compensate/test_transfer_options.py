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
