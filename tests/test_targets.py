"""The target registry: the one place that knows each target's names, types and entry points."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from laco_deploy.config import BuildConfig, ExportConfig, ModelConfig
from laco_deploy.pipeline_stages import Layout
from laco_deploy.targets import GGUF, ONNX, RUNTIMES, TARGETS, _load, target_for_path


def test_gguf_types_are_the_exporters_table():
    from exporters.gguf_names import QUANTS

    assert set(GGUF.quant_types) == set(QUANTS) and GGUF.default_quant in GGUF.quant_types
    assert ONNX.default_quant in ONNX.quant_types
    # the types llama.cpp's quantizer makes are those an importance matrix steers
    assert set(GGUF.imatrix_quants) == {q for q, spec in QUANTS.items() if spec.tensor_type is None}
    assert ONNX.imatrix_quants == ()
    assert ExportConfig(target="onnx", imatrix="m.gguf").validate() == [
        "export.imatrix is for gguf k-quants; onnx takes no importance matrix: unset export.imatrix"]


@pytest.mark.parametrize("target", list(TARGETS.values()), ids=list(TARGETS))
def test_entry_points_resolve(target):
    for entry in (target.exporter, target.runner, target.benchmark):
        assert callable(_load(entry)), entry
    assert RUNTIMES[target.runtime] is target


def test_config_reads_the_registry():
    for target in TARGETS.values():
        assert ExportConfig(target=target.name).resolved_quant == target.default_quant
        assert ExportConfig(target=target.name).validate() == []
    assert ExportConfig(target="tflite").validate() == ["export.target 'tflite' is not one of gguf, onnx"]


def test_build_layout_names(tmp_path):
    """The build folder's names are what they were before the registry (reused builds stay reusable)."""
    root = tmp_path / "b"
    gguf = Layout(root, "gguf", "q8_0")
    assert gguf.exported() == root / "model.q8_0.gguf"
    assert gguf.exported("dense") == root / "reference" / "dense.q8_0.gguf"
    onnx = Layout(root, "onnx", "int8")
    assert onnx.exported() == root / "onnx-int8"
    assert onnx.exported("pruned") == root / "reference" / "pruned-onnx-int8"


def test_target_for_path(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    folder = tmp_path / "export"
    folder.mkdir()
    (folder / "model.onnx").write_bytes(b"")
    assert target_for_path(tmp_path / "m.gguf") is GGUF
    assert target_for_path(folder) is ONNX and target_for_path(folder / "model.onnx") is ONNX
    assert target_for_path(tmp_path) is None


def test_runtime_device():
    assert ONNX.runtime_device("cuda:1") == "cuda" and ONNX.runtime_device("cpu") == "cpu"
    assert GGUF.runtime_device("cuda") == "cpu"  # llama.cpp stays on the CPU in a build


def test_default_build_config_uses_a_registered_target():
    assert BuildConfig(model=ModelConfig(device="cpu")).export.target in TARGETS


def _name_comparisons(text: str, names: set[str]) -> list[str]:
    """Lines comparing with a target or runtime name: == / != / in (...) / case with the quoted name."""
    quoted = "|".join(re.escape(n) for n in sorted(names))
    pattern = re.compile(rf"""(==|!=)\s*["']({quoted})["']|["']({quoted})["']\s*(==|!=)"""
                         rf"""|\bin\s*[(\[{{][^)\]}}]*["']({quoted})["']|\bcase\s+["']({quoted})["']""")
    return [line.strip() for line in text.splitlines() if pattern.search(line)]


def test_name_comparison_scan_finds_a_branch():
    names = set(TARGETS) | set(RUNTIMES)
    assert _name_comparisons('if cfg.target == "gguf":\nx = rt in ("llama.cpp", "x")\n', names) == \
        ['if cfg.target == "gguf":', 'x = rt in ("llama.cpp", "x")']
    assert _name_comparisons('path = work / "gguf" / name\n', names) == []


def test_no_target_name_comparisons_outside_the_registry():
    """Choosing behaviour by target or runtime name happens in targets.py only (a Target's fields)."""
    root = Path(__file__).resolve().parents[1]
    names = set(TARGETS) | set(RUNTIMES)
    found = {}
    for folder in ("laco_deploy", "exporters", "benchmarks"):
        for path in (root / folder).rglob("*.py"):
            if path != root / "laco_deploy" / "targets.py":
                hits = _name_comparisons(path.read_text(), names)
                if hits:
                    found[str(path.relative_to(root))] = hits
    assert found == {}
