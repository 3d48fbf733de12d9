"""Build config: file + flags merge, unknown keys, and all invalid settings reported together."""

from __future__ import annotations

import pytest

from laco_deploy.buildconfig import merge, read_config_file
from laco_deploy.errors import ConfigError


def test_flags_override_file(tmp_path):
    f = tmp_path / "build.yaml"
    f.write_text("prune: {method: sparsegpt, sparsity: 0.6}\ndata: {samples: 16}\nexport: {target: onnx}\nout: here\n")
    cfg = merge(read_config_file(f), {"prune.sparsity": 0.4, "data.seqlen": 128, "prune.method": None})
    assert cfg.prune.method == "sparsegpt"  # from the file (flag unset)
    assert cfg.prune.sparsity == 0.4  # flag wins
    assert cfg.data.samples == 16 and cfg.data.seqlen == 128
    assert cfg.export.target == "onnx" and cfg.export.resolved_quant == "fp32"
    assert cfg.out == "here"


def test_unknown_keys_are_named(tmp_path):
    f = tmp_path / "b.yaml"
    f.write_text("prune: {sparsty: 0.5}\nbogus: 1\n")
    with pytest.raises(ConfigError) as e:
        merge(read_config_file(f), {})
    assert "prune.sparsty" in str(e.value) and "'bogus'" in str(e.value)


def test_invalid_combinations_reported_together():
    with pytest.raises(ConfigError) as e:
        merge({}, {"prune.structured": 0.3, "prune.pattern": "2:4", "compensate.method": "lora",
                   "export.target": "gguf", "export.sparse_storage": True, "prune.sparsity": 1.5})
    msg = str(e.value)
    for needle in ("prune.structured and prune.pattern", "compensate.method lora with prune.structured",
                   "export.sparse_storage only applies", "prune.sparsity 1.5"):
        assert needle in msg


def test_bad_yaml(tmp_path):
    f = tmp_path / "b.yaml"
    f.write_text("prune: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        read_config_file(f)
    with pytest.raises(ConfigError, match="not found"):
        read_config_file(tmp_path / "none.yaml")


def test_quant_aware_laco_is_the_default_where_the_target_says_so(tmp_path, caplog):
    with caplog.at_level("INFO", logger="laco_deploy.buildconfig"):
        assert merge({}, {"export.quant": "q4_k_m"}).compensate.quant_aware == "q4_k_m"
    assert "quantization-aware LaCo on" in caplog.text
    assert merge({}, {}).compensate.quant_aware is None  # q8_0: not measured to help
    assert merge({"compensate": {"quant_aware": None}}, {"export.quant": "q4_k_m"}).compensate.quant_aware is None
    assert merge({"compensate": {"quant_aware": "q6_k"}}, {"export.quant": "q4_k_m"}).compensate.quant_aware == "q6_k"
    assert merge({}, {"export.quant": "q4_k_m", "compensate.method": "none"}).compensate.quant_aware is None
    # structured: measured to hurt at Q4_K_M, so not a default there
    assert merge({}, {"export.quant": "q4_k_m", "prune.structured": 0.3}).compensate.quant_aware is None


def test_imatrix_keeps_quant_aware_laco_off_unless_asked(caplog):
    """The QA-LaCo default was measured without an importance matrix; asked for, it trains through the
    weighted quantizer with the importance its export uses (compensate.quant_imatrix calib)."""
    with caplog.at_level("INFO", logger="laco_deploy.buildconfig"):
        assert merge({}, {"export.quant": "q4_k_m", "export.imatrix": "calib"}).compensate.quant_aware is None
    assert "quantization-aware LaCo stays off" in caplog.text
    cfg = merge({"compensate": {"quant_aware": "q4_k_m"}}, {"export.quant": "q4_k_m", "export.imatrix": "calib"})
    assert cfg.compensate.quant_aware == "q4_k_m" and cfg.compensate.quant_imatrix == "calib"
    assert merge({"compensate": {"quant_aware": "q4_k_m"}}, {"export.quant": "q4_k_m"}).compensate.quant_imatrix is None
