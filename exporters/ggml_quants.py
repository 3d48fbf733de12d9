"""llama.cpp's own row quantizer (`ggml_quantize_chunk` in the ggml library llama-cpp-python ships),
called through ctypes: the exact bytes `llama_model_quantize` writes for a tensor of a given type,
with or without an importance matrix, for every GGML type, without reimplementing its searches.

    quantize(weight [rows, n] float32, qtype, imatrix [n] | None) -> bytes   (the tensor's GGUF data)
    fake_quantize(weight, qtype, imatrix) -> dequantize(quantize(...))       [rows, n] float32

This is the building block for training through the exported weights at any k-quant (issue 32):
the per-tensor types of a `--quant` mix are read from a file llama.cpp quantized.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import gguf
import numpy as np

from laco_deploy.errors import ExportError


@functools.lru_cache(maxsize=1)
def _ggml() -> ctypes.CDLL:
    try:
        import llama_cpp
    except ImportError as e:
        raise ExportError("llama.cpp's quantizer needs llama-cpp-python: pip install llama-cpp-python") from e
    libs = sorted((Path(llama_cpp.__file__).parent / "lib").glob("libggml-base.*"))
    if not libs:
        raise ExportError(f"no libggml-base in {Path(llama_cpp.__file__).parent / 'lib'}; reinstall llama-cpp-python")
    lib = ctypes.CDLL(str(libs[0]))  # the copy llama_cpp already loaded
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.ggml_row_size.restype = ctypes.c_size_t
    lib.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
    lib.ggml_quantize_init.argtypes = [ctypes.c_int]
    return lib


def quantize(weight: np.ndarray, qtype: gguf.GGMLQuantizationType, imatrix: np.ndarray | None = None) -> bytes:
    """`weight` [rows, n] as llama.cpp stores it in type `qtype` (`imatrix` [n]: importance per column)."""
    w = np.ascontiguousarray(weight, dtype=np.float32)
    rows, n = w.shape
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if n % block:
        raise ExportError(f"rows of {n} values do not fill {qtype.name} blocks of {block}")
    imat = None if imatrix is None else np.ascontiguousarray(imatrix, dtype=np.float32)
    if imat is not None and imat.shape != (n,):
        raise ExportError(f"importance matrix of {imat.shape} values for rows of {n}")
    lib = _ggml()
    lib.ggml_quantize_init(int(qtype))
    out = np.empty(rows * lib.ggml_row_size(int(qtype), n), dtype=np.uint8)
    size = lib.ggml_quantize_chunk(int(qtype), w.ctypes.data, out.ctypes.data, 0, rows, n,
                                   imat.ctypes.data if imat is not None else None)
    assert size == out.size, (size, out.size)
    return out.tobytes()


def fake_quantize(weight: np.ndarray, qtype: gguf.GGMLQuantizationType, imatrix: np.ndarray | None = None) -> np.ndarray:
    """What llama.cpp computes with after quantizing `weight` to `qtype`. [rows, n] float32"""
    data = np.frombuffer(quantize(weight, qtype, imatrix), dtype=np.uint8).reshape(weight.shape[0], -1)
    return gguf.quants.dequantize(data, qtype).reshape(weight.shape)
