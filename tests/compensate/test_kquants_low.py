"""The k-quants against llama.cpp itself: each quantizer equals ggml's reference quantizer bit for bit
(called through the libggml-base that llama-cpp-python ships), and GGUF files that llama.cpp
quantized as Q2_K, Q3_K_S/M and Q5_K_S/M hold the per-tensor types `tensor_scheme` names and the
values our fake quantization computes."""

from __future__ import annotations

import ctypes
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from test_fakequant import gguf_vs_fake

import tiny
from laco_deploy.compensate import fakequant

T = gguf.GGMLQuantizationType
QUANTIZERS = {"q2_k": T.Q2_K, "q3_k": T.Q3_K, "q4_k": T.Q4_K, "q5_k": T.Q5_K, "q6_k": T.Q6_K, "q4_0": T.Q4_0,
              "q5_1": T.Q5_1}


@pytest.fixture(scope="module")
def ggml():
    """libggml-base of the installed llama-cpp-python, with `ggml_quantize_chunk` typed."""
    llama_cpp = pytest.importorskip("llama_cpp")
    libs = sorted((Path(llama_cpp.__file__).parent / "lib").glob("libggml-base.*"))
    if not libs:
        pytest.skip("llama-cpp-python ships no libggml-base here")
    lib = ctypes.CDLL(str(libs[0]))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    return lib


def _llama_cpp_round_trip(lib, w: np.ndarray, qtype: T) -> np.ndarray:
    """ggml's quantizer without an importance matrix (what llama_model_quantize runs: the *_ref
    functions), dequantized by gguf-py. [rows, cols] float32 -> [rows, cols]"""
    w = np.ascontiguousarray(w, dtype=np.float32)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    out = np.zeros(w.size // block * size, dtype=np.uint8)
    lib.ggml_quantize_chunk(int(qtype), w.ctypes.data, out.ctypes.data, 0, w.shape[0], w.shape[1], None)
    return gguf.quants.dequantize(out.reshape(w.shape[0], -1), qtype)


def _matrix(kind: str, rows: int = 256, cols: int = 1024) -> torch.Tensor:
    """pruned: half the weights +0.0, 1% outliers x8, an all-zero super-block and sub-block;
    squared: all >= 0 (every sub-block's min clamps to 0); wide: unit scale, nothing pruned."""
    gen = torch.Generator().manual_seed({"pruned": 0, "squared": 1, "wide": 2}[kind])
    w = torch.randn(rows, cols, generator=gen)
    if kind == "pruned":
        w = w * 0.05
        w[torch.rand(rows, cols, generator=gen) < 0.01] *= 8
        w[w.abs() < w.abs().median()] = 0.0
        w[3, :256] = 0.0
        w[5, 16:32] = 0.0
    elif kind == "squared":
        w = (w * 0.1).square()
    return w


@pytest.mark.parametrize("kind", ["pruned", "squared", "wide"])
@pytest.mark.parametrize("scheme", sorted(QUANTIZERS))
def test_quantizer_equals_llama_cpp_bit_for_bit(ggml, scheme, kind):
    """262,144 values per case; measured: 0 differ for every scheme and matrix (kquants.py)."""
    w = _matrix(kind)
    ref = _llama_cpp_round_trip(ggml, w.numpy(), QUANTIZERS[scheme])
    mine = fakequant.fake_quantize(w, scheme).numpy()
    assert int((mine != ref).sum()) == 0


def test_grid_reuse_rounds_like_the_exporter_on_the_searched_weights():
    """grid + apply on the weights the grid was searched on is the full quantizer."""
    w = _matrix("pruned", 32, 512)
    for scheme, (search, apply) in fakequant._GRIDS.items():
        assert torch.equal(apply(w, search(w)), fakequant.fake_quantize(w, scheme)), scheme


def _pruned_llama(layers: int, kv_heads: int, seed: int):
    """A width-256 Llama (4 query heads sharing `kv_heads` KV heads), half of its linear weights pruned."""
    config = tiny.llama_config(layers=layers, hidden=256)
    config.num_key_value_heads = kv_heads
    model = tiny.build_model(config, seed=seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("proj.weight"):
                p[p.abs() < p.abs().median()] = 0.0
    return model


@pytest.fixture(scope="module")
def f32_ggufs(tmp_path_factory, bpe_tokenizer) -> dict[str, tuple[Path, Path]]:
    """{name: (HF dir, its F32 GGUF)}: gqa2 (8 layers, 2 query heads per KV head) and gqa4 (16 layers,
    4 per KV head: Q2_K's attn_v is then Q4_K; and Q3_K_M's ffn_down is Q5_K in layer 0 of 16)."""
    pytest.importorskip("llama_cpp")
    from exporters import gguf as gguf_export

    root = tmp_path_factory.mktemp("kq_low")
    out = {}
    for name, layers, kv, seed in (("gqa2", 8, 2, 3), ("gqa4", 16, 1, 4)):
        model_dir = tiny.save_tiny(_pruned_llama(layers, kv, seed), bpe_tokenizer, root / name)
        gguf_export.export(model_dir, root / f"{name}.f32.gguf", "f32")
        out[name] = (model_dir, root / f"{name}.f32.gguf")
    return out


def _llama_quantize(src: Path, dst: Path, quant: str) -> None:
    """llama.cpp's quantizer for ftype `quant` (the child process exporters.gguf runs), any ftype."""
    ftype = f"LLAMA_FTYPE_MOSTLY_{quant.upper()}"
    subprocess.run([sys.executable, "-m", "exporters.llama_quantize_job", str(src), str(dst), ftype], check=True,
                   cwd=Path(__file__).resolve().parents[2])


def _assert_types_and_values(rows, types: set[str]) -> None:
    assert {r[1] for r in rows} == types
    for name, ltype, scheme, ref, mine, _w in rows:
        assert ltype == scheme, name
        assert int((mine != ref).sum()) == 0, name


@pytest.mark.parametrize("model,quant,types", [
    ("gqa2", "q2_k", {"q2_k", "q3_k"}),
    ("gqa4", "q2_k", {"q2_k", "q3_k", "q4_k"}),
    ("gqa2", "q3_k_s", {"q3_k"}),
    ("gqa4", "q3_k_m", {"q3_k", "q4_k", "q5_k"}),
    ("gqa2", "q5_k_s", {"q5_k"}),
    ("gqa4", "q5_k_m", {"q5_k", "q6_k"}),
])
def test_llama_cpp_types_and_values(f32_ggufs, tmp_path, model, quant, types):
    """Each decoder linear of llama.cpp's file has the type tensor_scheme names and, dequantized,
    our fake quantization's values bit for bit."""
    model_dir, f32 = f32_ggufs[model]
    _llama_quantize(f32, tmp_path / "q.gguf", quant)
    _assert_types_and_values(gguf_vs_fake(model_dir, tmp_path / "q.gguf", quant), types)


@pytest.mark.parametrize("quant,types", [("q2_k", {"q4_0"}), ("q3_k_m", {"q4_0", "q5_0", "q5_1"}),
                                         ("q5_k_m", {"q5_1", "q8_0"})])
def test_fallbacks_match_llama_cpp_bit_for_bit(tiny_llama_dir, tmp_path, quant, types):
    """Rows of 64/128 fit no super-block: Q2_K and Q3_K fall back to Q4_0, Q4_K to Q5_0, Q5_K to Q5_1,
    Q6_K to Q8_0."""
    from exporters import gguf as gguf_export

    pytest.importorskip("llama_cpp")
    gguf_export.export(tiny_llama_dir, tmp_path / "f32.gguf", "f32")
    _llama_quantize(tmp_path / "f32.gguf", tmp_path / "q.gguf", quant)
    _assert_types_and_values(gguf_vs_fake(tiny_llama_dir, tmp_path / "q.gguf", quant), types)
