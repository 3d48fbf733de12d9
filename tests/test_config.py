"""Settings validation: every invalid value is named, and all are reported together."""

from __future__ import annotations

from laco_deploy.config import BuildConfig, CompensateConfig, DataConfig, ExportConfig, ModelConfig, PruneConfig


def test_defaults_are_valid():
    assert BuildConfig().validate() == []


def test_prune_bad_values():
    assert any("[0, 1)" in e for e in PruneConfig(sparsity=1.0).validate())
    assert any("[0, 1)" in e for e in PruneConfig(sparsity=-0.1).validate())
    assert any("0 < N < M" in e for e in PruneConfig(pattern="4:4").validate())
    assert any("N:M" in e for e in PruneConfig(pattern="2-4").validate())
    assert any("magnitude, wanda, sparsegpt" in e for e in PruneConfig(method="random").validate())
    assert any("(0, 1)" in e for e in PruneConfig(structured=1.0).validate())


def test_all_errors_reported_together():
    cfg = BuildConfig(
        model=ModelConfig(device="tpu"),
        data=DataConfig(samples=0),
        prune=PruneConfig(sparsity=2.0),
        compensate=CompensateConfig(loss="l7"),
        export=ExportConfig(target="gguf", quant="int8"),
    )
    errs = cfg.validate()
    assert len(errs) == 5
    joined = " ".join(errs)
    for needle in ("model.device 'tpu'", "data.samples 0", "prune.sparsity 2.0", "compensate.loss 'l7'", "export.quant 'int8'"):
        assert needle in joined


def test_export_quant_defaults_per_target():
    assert ExportConfig(target="gguf").resolved_quant == "q8_0"
    assert ExportConfig(target="onnx").resolved_quant == "fp32"
    assert ExportConfig(target="onnx", quant="int8").validate() == []


def test_every_named_method_and_loss_has_an_implementation():
    """config names the values once; the implementations cover exactly those names (DESIGN.md rows
    'a pruning method', 'a loss'), so adding a name without its code, or code without its name, fails."""
    from laco_deploy.compensate.losses import LOSS_FUNCTIONS
    from laco_deploy.config import LOSSES, PRUNE_METHODS
    from laco_deploy.prune.step import STATISTICS

    assert tuple(STATISTICS) == PRUNE_METHODS
    assert tuple(LOSS_FUNCTIONS) == LOSSES
    assert CompensateConfig(loss="huber").validate() and PruneConfig(method="obs").validate()
