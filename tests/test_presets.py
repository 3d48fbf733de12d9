"""`build --preset`: presets resolve to their documented settings, sit under the config file and
flags, and an unknown name is one clear error."""

from __future__ import annotations

from pathlib import Path

import pytest

from laco_deploy.buildconfig import merge
from laco_deploy.errors import ConfigError
from laco_deploy.presets import PRESETS, describe, layer, preset_values

ROOT = Path(__file__).resolve().parents[1]


def _resolve(name: str, file_values: dict | None = None, flags: dict | None = None):
    flags = flags or {}
    return merge(layer(preset_values(name), file_values or {}, {k for k, v in flags.items() if v is not None}), flags)


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_resolves_to_its_table_entry(name):
    cfg = _resolve(name)
    for section, values in PRESETS[name].settings.items():
        for key, value in values.items():
            assert getattr(getattr(cfg, section), key) == value, f"{name}: {section}.{key}"


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_is_documented_with_its_numbers(name):
    """README, RESULTS.md and --help name each preset with the settings it resolves to."""
    readme, results = (ROOT / "README.md").read_text(), (ROOT / "benchmarks" / "RESULTS.md").read_text()
    line = f"`{name}`: {describe(PRESETS[name])}"
    assert line in readme and line in results
    assert PRESETS[name].measured in readme and PRESETS[name].measured in results


def test_flags_and_file_override_a_preset():
    balanced = PRESETS["balanced"].settings
    cfg = _resolve("balanced", {"data": {"samples": 8}}, {"compensate.epochs": 2})
    assert cfg.data.samples == 8 and cfg.compensate.epochs == 2
    assert cfg.prune.structured == balanced["prune"]["structured"]
    cfg = _resolve("balanced", flags={"prune.pattern": "2:4"})  # another pattern replaces the preset's as a whole
    assert cfg.prune.pattern == "2:4" and cfg.prune.structured is None
    cfg = _resolve("balanced", {"prune": {"sparsity": 0.4}})
    assert cfg.prune.sparsity == 0.4 and cfg.prune.structured is None

    qa = {"prune": {"structured": 0.3}, "compensate": {"quant_aware": "q4_k_m"}, "export": {"quant": "q4_k_m"}}
    cfg = merge(layer(qa, {}, {"export.quant"}), {"export.quant": "q8_0"})  # a quant-aware type follows its export type
    assert cfg.export.quant == "q8_0" and cfg.compensate.quant_aware is None


def test_unknown_preset_lists_the_names():
    with pytest.raises(ConfigError) as e:
        preset_values("fastest")
    assert "'fastest'" in str(e.value) and all(name in str(e.value) for name in PRESETS)


def test_cli_unknown_preset_is_one_line_exit_2(cli, tmp_path):
    code, _, err = cli("build", "--preset", "fastest", "--out", tmp_path / "b")
    assert code == 2 and "preset 'fastest' is not one of" in err and "Traceback" not in err
    assert not (tmp_path / "b").exists()


def test_cli_preset_reaches_the_build(cli, tmp_path, monkeypatch):
    import laco_deploy.pipeline

    seen = {}

    def fake_build(cfg, on_stage=None, checked=None, size_budget=None):
        seen["cfg"] = cfg
        raise ConfigError("stopped by the test")

    monkeypatch.setattr(laco_deploy.pipeline, "build", fake_build)
    code, _, _ = cli("build", "--preset", "balanced", "--samples", "4", "--out", tmp_path / "b")
    assert code == 2 and seen["cfg"].data.samples == 4
    assert seen["cfg"].prune.structured == PRESETS["balanced"].settings["prune"]["structured"]
    assert "--preset" in cli("build", "--help")[1]
