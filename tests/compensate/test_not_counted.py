"""A FLOP counter that fails records "not counted" and the run goes on to the same weights."""

from __future__ import annotations

import logging

import pytest
import torch
from test_laco import DATA, _cfg, _weights

from laco_deploy import flops
from laco_deploy.compensate import run
from laco_deploy.config import ModelConfig


@pytest.mark.parametrize("method", ["laco", "lora"])
def test_a_failing_counter_is_recorded_not_fatal(tiny_llama_dir, sparse_unstructured_dir, tmp_path, monkeypatch,
                                                 caplog, method):
    model, cfg = ModelConfig(model=str(tiny_llama_dir)), _cfg(epochs=1, method=method)
    run(model, DATA, cfg, sparse_unstructured_dir, tmp_path / "counted")

    def asserts(*_a, **_k):  # as torch 2.11's sdpa formula did on grouped-query shapes
        raise AssertionError("sdpa_flop_count: query/key/value shapes are incompatible")

    monkeypatch.setattr(flops, "_forward", asserts)
    with caplog.at_level(logging.DEBUG, logger="laco_deploy.flops"):
        res = run(model, DATA, cfg, sparse_unstructured_dir, tmp_path / "not_counted")
    assert res.settings["throughput"]["gflop"] == "not counted"
    assert any("throughput not counted" in n for n in res.notes)
    assert any("FLOPs not counted" in r.getMessage() and "incompatible" in r.getMessage() for r in caplog.records)
    a, b = _weights(tmp_path / "counted"), _weights(tmp_path / "not_counted")
    assert all(torch.equal(a[k], b[k]) for k in a)  # the measurement changed nothing
