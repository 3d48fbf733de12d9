"""The measured configurations `build --size` chooses from: the speed/quality frontier's own rows
(benchmarks/frontier_bench.py, tables in benchmarks/RESULTS.md "Speed/quality frontier"), as data.

Each row is one model (dense, or pruned + recovered) at one weight type, measured on the default
model (SmolLM2-135M-Instruct): its file size and its runtime perplexity, with the dense model's
perplexity of the same run, so that quality is a ratio to dense. Its size carries over to another
model in three parts: the token embedding (and head) at the bits per weight its export type stores
them with (EMBED_BITS), the rest (the decoder layers) at the bits per weight the row's file leaves for
them on the default model (pruning shows there: fewer weights kept per dense weight), and the file's
own metadata per vocabulary entry (the tokenizer), measured on the dense F16 / fp32 files. On the
default model this gives back the measured file; on Gemma 3 270M (63% embedding) dense Q8_0 and
Q4_K_M come out 1-2% above the real files, where one number of bits per weight for the whole model
would be 17% below at Q4_K_M. tests/test_budget_table.py checks every number against RESULTS.md,
so the table cannot drift from the measurements.

Left out on purpose: pruned models without recovery (at every size a recovered or dense row beats
them) and 2:4 + QA-LaCo (not measured).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from laco_deploy.config import FFN_LINEARS, IMATRIX_CALIB, PRUNABLE_LINEARS
from laco_deploy.targets import GGUF, TARGETS

MEASURED_ON = "SmolLM2-135M-Instruct"
MEASURED_VOCAB = 49152
MEASURED_EMBED = MEASURED_VOCAB * 576  # the tied embedding, stored once
# its parameters: the embedding, 30 layers of attention (576 x 576 q/o, 576 x 192 k/v) + gated MLP
# (3 x 576 x 1536) + 2 norms, the final norm
MEASURED_PARAMS = MEASURED_EMBED + 30 * (2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536 + 2 * 576) + 576
MIB = 2**20
# bits per weight of the token embedding (and head) by export type. GGUF k-quants: llama.cpp stores a
# tied embedding as the output tensor, Q6_K (6.56), or Q8_0 (8.5) where its rows are not a multiple of
# 256 (SmolLM2's 576, Gemma 3's 640): 8.5, an over-estimate for the others. ONNX int8 quantizes MatMul
# weights only: the embedding's Gather table stays fp32.
EMBED_BITS = {"f32": 32.0, "f16": 16.0, "bf16": 16.0, "q8_0": 8.5,
              **dict.fromkeys(GGUF.imatrix_quants, 8.5),  # the k-quant mixes
              "fp32": 32.0, "fp16": 16.0, "int8": 32.0}


@dataclass(frozen=True)
class ModelShape:
    """What a file's size depends on: parameters (tied weights once), of them the token embedding and
    an untied head, and the vocabulary (the tokenizer the file carries)."""

    params: int
    embed: int
    vocab: int


MEASURED_SHAPE = ModelShape(MEASURED_PARAMS, MEASURED_EMBED, MEASURED_VOCAB)


@dataclass(frozen=True)
class Source:
    """One measurement run: the RESULTS.md section, its dense perplexity and its protocol."""

    section: str  # the heading in benchmarks/RESULTS.md
    dense_ppl: float  # the dense model's perplexity in the same run: quality = ppl / dense_ppl
    protocol: str


SOURCES = {
    "grid": Source("The full grid at today's LaCo (2026-12-04, seventh session)", 19.13,
                   "llama.cpp / onnxruntime perplexity, 4 x 256-token windows of the builtin text; dense F16 19.13; "
                   "LaCo at half the build's CPU budget (128 + 128 samples)"),
    "imatrix": Source("The fair rival: llama.cpp's importance-matrix k-quants of the dense model (2026-12-04, issue 32)",
                      19.13, "llama.cpp perplexity, 4 x 256-token windows of the builtin text; dense F16 19.13"),
    "qa": Source("QA-LaCo on the dense model beats llama.cpp's importance-matrix k-quants at equal size "
                 "(2026-12-05, eleventh session)", 19.28,
                 "llama.cpp perplexity over the 5 evaluation texts (80 windows); dense fp32 PyTorch 19.28; "
                 "LaCo on 128 samples"),
    "qaw": Source("QA-LaCo from llama.cpp's importance-weighted grid: Q3_K_M within 40% of imatrix's gap "
                  "(2026-12-05, issue 32 item 2)", 19.28,
                  "llama.cpp perplexity over the 5 evaluation texts (80 windows); dense fp32 PyTorch 19.28; "
                  "LaCo on 128 samples through the quantizer weighted by the calibration text's importance matrix"),
}

# label -> {weight type: (file MiB, perplexity)}; labels as in the frontier tables
GRID: dict[str, dict[str, tuple[float, float]]] = {
    "dense": {"f16": (258.3, 19.13), "q8_0": (138.1, 19.30), "q6_k": (132.0, 19.23), "q5_k_m": (106.9, 19.77),
              "q4_k_m": (100.6, 19.67), "q3_k_m": (89.2, 20.91), "q2_k": (84.1, 24.83),
              "fp32": (513.5, 19.13), "int8": (222.5, 19.28)},
    "s20-ffn+laco": {"f16": (226.7, 25.56), "q8_0": (121.3, 25.73), "q4_k_m": (93.3, 26.62), "fp32": (450.3, 25.56),
                     "int8": (204.7, 25.77)},
    "s20-all+laco": {"f16": (209.8, 33.97), "q8_0": (112.3, 34.11), "q4_k_m": (87.3, 35.07), "fp32": (416.5, 33.97),
                     "int8": (195.2, 34.04)},
    "s30-ffn+laco": {"f16": (214.0, 28.92), "q8_0": (114.6, 29.06), "q4_k_m": (88.6, 30.05), "fp32": (424.9, 28.92),
                     "int8": (197.6, 29.14)},
    "s30-all+laco": {"f16": (197.2, 38.27), "q8_0": (105.6, 38.34), "q4_k_m": (82.6, 39.71), "fp32": (391.2, 38.27),
                     "int8": (188.1, 38.30)},
    "s50-ffn+laco": {"f16": (182.4, 42.51), "q8_0": (97.8, 42.61), "q4_k_m": (74.5, 45.19), "fp32": (361.7, 42.51),
                     "int8": (179.8, 42.64)},
    "s50-all+laco": {"f16": (148.7, 101.79), "q8_0": (79.8, 102.67), "q4_k_m": (62.6, 105.36),
                     "fp32": (294.2, 101.81), "int8": (160.8, 101.99)},
    "wanda50+laco": {"f16": (258.3, 26.66), "q8_0": (138.1, 26.70), "q4_k_m": (100.6, 27.88), "fp32": (513.5, 26.66),
                     "int8": (222.5, 26.80)},
    "2:4+laco": {"f16": (258.3, 36.83), "q8_0": (138.1, 36.99), "q4_k_m": (100.6, 37.67), "fp32": (513.5, 36.83),
                 "int8": (222.5, 37.05)},
    "s20-ffn+qa-q4_k_m": {"q4_k_m": (93.3, 26.94)}, "s20-all+qa-q4_k_m": {"q4_k_m": (87.3, 35.26)},
    "s30-ffn+qa-q4_k_m": {"q4_k_m": (88.6, 31.64)}, "s30-all+qa-q4_k_m": {"q4_k_m": (82.6, 39.54)},
    "s50-ffn+qa-q4_k_m": {"q4_k_m": (74.5, 44.70)}, "s50-all+qa-q4_k_m": {"q4_k_m": (62.6, 105.34)},
    "wanda50+qa-q4_k_m": {"q4_k_m": (100.6, 27.80)},
}
IMATRIX = {"dense-imatrix": {"q4_k_m": (100.6, 19.29), "q3_k_m": (89.2, 20.90), "q2_k": (84.1, 22.78)}}
QA = {"dense+qa-q3_k_m": {"q3_k_m": (93_510_784 / MIB, 20.16)}, "dense+qa-q2_k": {"q2_k": (88_202_368 / MIB, 22.17)}}
# "qaw-": QA-LaCo through llama.cpp's importance-weighted quantizer (compensate.quant_imatrix), exported with it
QAW = {"dense+qaw-q3_k_m": {"q3_k_m": (93_511_168 / MIB, 19.94)},
       "dense+qaw-q2_k": {"q2_k": (88_202_752 / MIB, 20.94)}}


@dataclass(frozen=True)
class Row:
    label: str
    quant: str
    size_mib: float  # the file on the default model
    ppl: float
    source: str  # a key of SOURCES

    @property
    def ppl_ratio(self) -> float:
        """Perplexity over the dense model's in the same run (1.0 = as good as dense)."""
        return self.ppl / SOURCES[self.source].dense_ppl

    @property
    def target(self) -> str:
        return next(t.name for t in TARGETS.values() if self.quant in t.quant_types)

    @property
    def layer_bits(self) -> float:
        """Bits per dense weight outside the embedding that the file spends on the default model."""
        rest = self.size_mib * MIB - MEASURED_EMBED * EMBED_BITS[self.quant] / 8 - metadata_per_token(self.target) * MEASURED_VOCAB
        return rest * 8 / (MEASURED_PARAMS - MEASURED_EMBED)

    def file_bytes(self, shape: ModelShape) -> int:
        """The row's file for a model of `shape` (on the default model: the measured file)."""
        return int(shape.embed * EMBED_BITS[self.quant] / 8 + (shape.params - shape.embed) * self.layer_bits / 8
                   + metadata_per_token(self.target) * shape.vocab)


ROWS: tuple[Row, ...] = tuple(Row(label, quant, size, ppl, source)
                              for source, table in (("grid", GRID), ("imatrix", IMATRIX), ("qa", QA), ("qaw", QAW))
                              for label, cells in table.items() for quant, (size, ppl) in cells.items())


def metadata_per_token(target: str) -> float:
    """A file's bytes beyond its weights per vocabulary entry (mostly the tokenizer), from the dense
    model's unquantized file of `target` (GGUF F16: 258.3 MiB for 2 bytes x 134.5 M weights)."""
    quant, bits = {"gguf": ("f16", 16), "onnx": ("fp32", 32)}[target]
    return (GRID["dense"][quant][0] * MIB - MEASURED_PARAMS * bits / 8) / MEASURED_VOCAB


def _prune(family: str) -> dict[str, Any]:
    """The prune section of a frontier family: dense (nothing removed), sNN-ffn / sNN-all (structured
    NN% of the FFN channels, or of the FFN channels and KV head groups), wanda50, 2:4 (all Wanda)."""
    if family in ("dense", "dense-imatrix"):
        return {"method": "wanda", "sparsity": 0.0}
    if family == "wanda50":
        return {"method": "wanda", "sparsity": 0.5}
    if family == "2:4":
        return {"method": "wanda", "pattern": "2:4"}
    ratio, _, targets = family[1:].partition("-")
    return {"method": "wanda", "structured": int(ratio) / 100, "targets": FFN_LINEARS if targets == "ffn" else PRUNABLE_LINEARS}


def settings(row: Row) -> dict[str, dict[str, Any]]:
    """The config-file sections that build `row` (what a preset holds): its pruning, its recovery
    (none, LaCo, or QA-LaCo through the exported type, "qaw-" through its importance-weighted quantizer)
    and its export type and importance matrix."""
    family, _, recovery = row.label.partition("+")
    method = "none" if not recovery else "laco"
    kind, _, quant_aware = recovery.partition("-")
    weighted = kind == "qaw"
    compensate = {"method": method, "quant_aware": quant_aware or None, **({"quant_imatrix": IMATRIX_CALIB} if weighted else {})}
    imatrix = IMATRIX_CALIB if family == "dense-imatrix" or weighted else None
    return {"prune": _prune(family), "compensate": compensate,
            "export": {"target": row.target, "quant": row.quant, "imatrix": imatrix}}
