"""QA-LaCo through llama.cpp's importance-weighted quantizer (compensate.quant_imatrix): the stage keeps
the importance matrix it trained through, the export with it reproduces that grid bit for bit, the masks
stay, the layer's quantized error goes down, and a resumed run equals an uninterrupted one."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from test_fakequant import GGUF_NAMES, _layer0_error, kquant_sparse_dir  # noqa: F401 (a fixture)
from test_laco import DATA, _cfg, _weights, killed_then_resumed

from laco_deploy.compensate import kquants_weighted, run
from laco_deploy.config import ModelConfig
from laco_deploy.data import calibration_samples
from laco_deploy.imatrix import TRAINED_FILE, linear_importance, trained_with
from laco_deploy.models import load_model


@pytest.fixture(scope="module")
def weighted_run(kquant_sparse_dir, tmp_path_factory):  # noqa: F811
    dense, sparse = kquant_sparse_dir
    out = tmp_path_factory.mktemp("qa_imatrix") / "out"
    res = run(ModelConfig(model=str(dense)), DATA, _cfg(epochs=4, val_fraction=0.0, quant_aware="q2_k",
                                                        quant_imatrix="calib"), sparse, out)
    return dense, sparse, out, res


def test_the_stage_keeps_and_records_its_importance_matrix(weighted_run):
    dense, sparse, out, res = weighted_run
    assert trained_with(out) == out / TRAINED_FILE
    assert res.settings["compensate"]["quant_imatrix"] == "calib"
    assert json.loads((out / "config.json").read_text())["laco_deploy"]["quant_imatrix"] == "calib"
    a, b = _weights(sparse), _weights(out)
    for k in a:
        if k.endswith("proj.weight"):
            assert torch.equal(a[k] == 0, b[k] == 0), k  # the masks, bit for bit
    assert any(not torch.equal(a[k], b[k]) for k in a)


def test_the_layer_error_through_the_weighted_quantizer_goes_down(weighted_run):
    dense, sparse, out, res = weighted_run
    ids = calibration_samples(load_model(str(dense)).tokenizer, DATA.calib, DATA.samples, DATA.seqlen, DATA.seed)
    importance = linear_importance(out / TRAINED_FILE, out)
    before = _layer0_error(dense, sparse, "q2_k", ids, importance)
    after = _layer0_error(dense, out, "q2_k", ids, importance)
    assert after < 0.9 * before
    assert res.per_layer[0]["nmse_after"] == pytest.approx(after, rel=1e-3)  # the trainer measured through it too


def test_export_with_the_importance_matrix_reproduces_the_trained_grid(weighted_run, tmp_path):
    """llama.cpp's Q2_K of the recovered model with the stage's imatrix holds, per decoder linear, the
    values the weighted fake quantizer computed from the same weights: 0 differing."""
    pytest.importorskip("llama_cpp")
    import gguf

    from exporters import gguf as gguf_export
    from exporters import gguf_model

    _, _, out, _ = weighted_run
    gguf_export.export(out, tmp_path / "q.gguf", "q2_k", imatrix=trained_with(out))
    importance = linear_importance(out / TRAINED_FILE, out)
    plan = gguf_model.plan_model(gguf_model.read_config(out))
    f32 = dict(gguf_model.iter_tensors(out, plan))
    checked = 0
    for t in gguf.GGUFReader(str(tmp_path / "q.gguf")).tensors:
        parts = t.name.split(".")
        if parts[0] != "blk" or parts[2] not in GGUF_NAMES:
            continue
        w = torch.from_numpy(np.ascontiguousarray(f32[t.name]))
        scheme = t.tensor_type.name.lower()
        mine = kquants_weighted.fake_quantize(w, scheme, importance[f"{parts[1]}.{GGUF_NAMES[parts[2]]}"]).numpy()
        assert int((mine != gguf.quants.dequantize(t.data, t.tensor_type)).sum()) == 0, t.name
        checked += 1
    assert checked == 14


def test_weighted_resume_equals_uninterrupted(kquant_sparse_dir, tmp_path, monkeypatch):  # noqa: F811
    dense, sparse = kquant_sparse_dir
    ccfg = _cfg(epochs=1, quant_aware="q3_k_m", quant_imatrix="calib")
    full, resumed, _ = killed_then_resumed(ModelConfig(model=str(dense)), ccfg, sparse, tmp_path, monkeypatch)
    assert full.keys() == resumed.keys()
    for k in full:
        assert torch.equal(full[k], resumed[k]), k
