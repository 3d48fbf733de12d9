"""Compensation with streamed weights equals in-RAM compensation bit for bit (CPU)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from laco_deploy.compensate import run, streamed
from laco_deploy.config import CompensateConfig, DataConfig, ModelConfig

DATA = DataConfig(calib="builtin", samples=12, seqlen=32, seed=0)


def _cfg(**kw) -> CompensateConfig:
    # the walk alone: a streamed model skips the final KL pass (test_final_kl.py checks that)
    return CompensateConfig(**{"samples": 12, "epochs": 2, "batch_size": 4, "lr": 1e-3, "final_kl_epochs": 0, **kw})


def _weights(d: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _same_result(a: Path, b: Path, res_a, res_b) -> None:
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert wa[k].dtype == wb[k].dtype and torch.equal(wa[k], wb[k]), k
    assert json.loads((a / "sparsity.json").read_text()) == json.loads((b / "sparsity.json").read_text())
    ca, cb = (json.loads((d / "config.json").read_text()) for d in (a, b))
    assert ca["laco_deploy"] == cb["laco_deploy"]
    keys = ("nmse_before", "nmse_after", "loss_before", "loss_after")
    assert [[r[k] for k in keys] for r in res_a.per_layer] == [[r[k] for k in keys] for r in res_b.per_layer]


@pytest.mark.parametrize("fixture, extra", [
    ("sparse_unstructured_dir", {}),
    ("sparse_structured_dir", {}),
    ("sparse_24_dir", {"quant_aware": "q8_0"}),
])
def test_streamed_equals_in_ram_bit_for_bit(request, tiny_llama_dir, tmp_path, fixture, extra):
    sparse = request.getfixturevalue(fixture)
    dense = ModelConfig(model=str(tiny_llama_dir))
    in_ram = run(dense, DATA, _cfg(**extra), sparse, tmp_path / "ram")
    disk = run(dense, DATA, _cfg(offload="disk", **extra), sparse, tmp_path / "disk")
    _same_result(tmp_path / "ram", tmp_path / "disk", in_ram, disk)
    assert (tmp_path / "disk" / "model.safetensors.index.json").is_file()  # written shard by shard
    assert not (tmp_path / "disk.ckpt").exists()  # spilled layers and checkpoints removed
    assert disk.sparsity == in_ram.sparsity


def test_automatic_streaming_when_the_model_does_not_fit(tiny_llama_dir, sparse_unstructured_dir, tmp_path,
                                                         monkeypatch, caplog):
    dense = ModelConfig(model=str(tiny_llama_dir))
    in_ram = run(dense, DATA, _cfg(), sparse_unstructured_dir, tmp_path / "ram")
    monkeypatch.setattr(streamed, "available_bytes", lambda: 1000)  # bytes
    with caplog.at_level(logging.INFO, logger="laco_deploy.compensate.streamed"):
        auto = run(dense, DATA, _cfg(), sparse_unstructured_dir, tmp_path / "auto")
    assert any("streaming its layers from disk" in r.getMessage() for r in caplog.records)
    assert (tmp_path / "auto" / "model.safetensors.index.json").is_file()
    _same_result(tmp_path / "ram", tmp_path / "auto", in_ram, auto)


def test_streamed_resume_equals_uninterrupted(tiny_llama_dir, sparse_unstructured_dir, tmp_path, monkeypatch):
    from laco_deploy.compensate import laco

    dense = ModelConfig(model=str(tiny_llama_dir))
    full = run(dense, DATA, _cfg(offload="disk"), sparse_unstructured_dir, tmp_path / "full")
    real_step = laco.make_step

    def failing_make_step(*args, **kwargs):
        step = real_step(*args, **kwargs)

        def wrapped(ctx):
            if ctx.index == 1:
                raise KeyboardInterrupt
            return step(ctx)

        return wrapped

    monkeypatch.setattr(laco, "make_step", failing_make_step)
    with pytest.raises(KeyboardInterrupt):
        run(dense, DATA, _cfg(offload="disk"), sparse_unstructured_dir, tmp_path / "cut")
    monkeypatch.setattr(laco, "make_step", real_step)
    resumed = run(dense, DATA, _cfg(offload="disk"), sparse_unstructured_dir, tmp_path / "cut", resume=True)
    _same_result(tmp_path / "full", tmp_path / "cut", full, resumed)


def test_dense_twin_streams_one_layer_at_a_time(tiny_llama_dir, sparse_unstructured_dir, tmp_path, monkeypatch):
    """The dense model is never loaded whole: only the layer being compensated is off `meta`."""
    real_open = streamed.open_models
    live: list[int] = []

    def spy(*args, **kwargs):
        models = real_open(*args, **kwargs)
        real_load = models.dense_lazy.load

        def load(i, layer):
            real_load(i, layer)
            live.append(sum(not p.is_meta for p in models.dense.parameters()))

        models.dense_lazy.load = load
        return models

    monkeypatch.setattr(streamed, "open_models", spy)
    run(ModelConfig(model=str(tiny_llama_dir)), DATA, _cfg(epochs=1), sparse_unstructured_dir, tmp_path / "o")
    from laco_deploy.models import load_model

    per_layer = sum(1 for _ in load_model(str(tiny_llama_dir)).model.model.layers[0].parameters())
    assert live == [per_layer, per_layer]
