"""Importance matrices (llama.cpp's `--imatrix`) as files: written in llama.cpp's GGUF imatrix format,
read from it or from the legacy binary `.dat` that older `llama-imatrix` builds write.

An importance matrix holds, per weight matrix, the mean squared input of each input column over the
calibration tokens (Wanda's ||X_j||^2 / tokens). llama.cpp's k-quant search weights each column's
rounding error by it. The layout below is what llama.cpp (as vendored by llama-cpp-python 0.3.36,
tools/imatrix and common/imatrix-loader) writes and reads:

  GGUF: general.type "imatrix"; imatrix.datasets [str], imatrix.chunk_count u32, imatrix.chunk_size u32
        (the quantizer refuses a GGUF imatrix without these three); per weight `W` two F32 tensors,
        `W.in_sum2` [n_mat, n_in] (sum of squares over tokens) and `W.counts` [n_mat, 1] (tokens), where
        n_mat > 1 only for stacked expert weights. The quantizer uses in_sum2 / counts (1 where count 0).
  .dat: int32 n; n x (int32 len, name, int32 ncall, int32 nval, f32[nval] = mean * ncall); optionally
        int32 chunk_count, int32 len, dataset name. The quantizer uses values / ncall.
"""

from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from exporters.gguf_names import EXPORTER_KEY
from laco_deploy import __version__
from laco_deploy.errors import ExportError
from laco_deploy.fsutil import atomic_path

SUMS, COUNTS = ".in_sum2", ".counts"


@dataclass(frozen=True)
class Imatrix:
    """What llama.cpp's quantizer receives: GGUF weight name -> [n_mat * n_in] float32 mean squares."""

    values: dict[str, np.ndarray]
    datasets: tuple[str, ...] = ()
    chunk_count: int = 0
    chunk_size: int = 0


def write(path: Path, sums: dict[str, np.ndarray], counts: dict[str, int], *, datasets: list[str],
          chunk_count: int, chunk_size: int, arch: str) -> None:
    """Write a GGUF imatrix (atomically). sums: weight name -> [n_in] sum of squared inputs over
    `counts[name]` tokens; chunk_count x chunk_size: the calibration samples x their tokens."""
    if not sums:
        raise ExportError(f"no importance data to write to {path}: the model has no weight matrices in decoder layers")
    writer_path = Path(path)
    with atomic_path(writer_path) as tmp:
        writer = gguf.GGUFWriter(str(tmp), arch)
        writer.add_type(gguf.GGUFType.IMATRIX)
        writer.add_string(EXPORTER_KEY, f"laco-deploy {__version__}")  # a rerun may replace it (with --force)
        # the quantizer needs the key; the gguf package drops empty arrays, so an unnamed source gets a name
        writer.add_array(gguf.Keys.IMatrix.DATASETS, list(datasets) or ["unnamed"])
        writer.add_uint32(gguf.Keys.IMatrix.CHUNK_COUNT, int(chunk_count))
        writer.add_uint32(gguf.Keys.IMatrix.CHUNK_SIZE, int(chunk_size))
        for name in sorted(sums):  # llama-imatrix's order, so equal data give equal files
            values = np.asarray(sums[name], dtype=np.float32).reshape(1, -1)
            if not np.isfinite(values).all():
                raise ExportError(f"importance data of {name} is not finite; the model's activations overflow "
                                  "(check the model in fp32 with `laco-deploy fidelity`)")
            writer.add_tensor(name + SUMS, values)
            writer.add_tensor(name + COUNTS, np.array([[counts[name]]], dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()


def read(path: Path) -> Imatrix:
    """An imatrix file as llama.cpp's quantizer reads it: GGUF, else the legacy binary format."""
    path = Path(path)
    if not path.is_file():
        raise ExportError(f"imatrix file {path} not found; write one with `laco-deploy imatrix` or llama.cpp's llama-imatrix")
    with path.open("rb") as f:
        magic = f.read(4)
    imatrix = _read_gguf(path) if magic == b"GGUF" else _read_legacy(path)
    for name, v in imatrix.values.items():
        if not np.isfinite(v).all():
            raise ExportError(f"imatrix {path}: {name} holds non-finite values; recompute the importance matrix")
    return imatrix


def _field(reader: gguf.GGUFReader, key: str):
    f = reader.get_field(key)
    return None if f is None else f.contents()


def _read_gguf(path: Path) -> Imatrix:
    try:
        reader = gguf.GGUFReader(str(path), "r")
    except (ValueError, OSError) as e:
        raise ExportError(f"imatrix {path} is not a readable GGUF file ({e}); recompute it") from e
    datasets, chunks, size = (_field(reader, k) for k in (gguf.Keys.IMatrix.DATASETS, gguf.Keys.IMatrix.CHUNK_COUNT,
                                                           gguf.Keys.IMatrix.CHUNK_SIZE))
    if datasets is None or chunks is None or size is None:
        raise ExportError(f"imatrix {path} lacks imatrix.datasets/chunk_count/chunk_size (llama.cpp's quantizer refuses "
                          "it); rewrite it with `laco-deploy imatrix` or a current llama-imatrix")
    tensors = {t.name: t for t in reader.tensors}
    values = {}
    for full, t in tensors.items():
        if not full.endswith(SUMS):
            continue
        name = full[: -len(SUMS)]
        c = tensors.get(name + COUNTS)
        if c is None or t.tensor_type != gguf.GGMLQuantizationType.F32 or c.tensor_type != gguf.GGMLQuantizationType.F32:
            raise ExportError(f"imatrix {path}: {name} needs F32 {SUMS} and {COUNTS} tensors; recompute the importance matrix")
        counts = np.round(np.asarray(c.data, dtype=np.float64).reshape(-1, 1))  # llama.cpp rounds them too
        sums = np.asarray(t.data, dtype=np.float64).reshape(len(counts), -1)
        mean = np.where(counts > 0, sums / np.maximum(counts, 1), 1.0)  # an expert never routed to: 1
        values[name] = mean.astype(np.float32).reshape(-1)
    if not values:
        raise ExportError(f"imatrix {path} holds no {SUMS} tensors; it is not an importance matrix")
    return Imatrix(values, tuple(datasets), int(chunks), int(size))


def _read_legacy(path: Path) -> Imatrix:
    data = path.read_bytes()
    pos = 0

    def take(fmt: str):
        nonlocal pos
        size = struct.calcsize(fmt)
        if pos + size > len(data):
            raise ExportError(f"imatrix {path} is truncated at byte {pos} (neither GGUF nor llama.cpp's legacy "
                              "format); recompute it")
        out = struct.unpack_from(fmt, data, pos)
        pos += size
        return out

    (n,) = take("<i")
    if n < 1:
        raise ExportError(f"imatrix {path}: not GGUF, and as llama.cpp's legacy format it holds {n} entries; recompute it")
    values = {}
    for _ in range(n):
        (length,) = take("<i")
        name = take(f"<{length}s")[0].decode("utf-8", "replace")
        ncall, nval = take("<ii")
        if nval < 1:
            raise ExportError(f"imatrix {path}: entry {name!r} has {nval} values; recompute it")
        v = np.asarray(take(f"<{nval}f"), dtype=np.float32)
        values[name] = v / ncall if ncall > 0 else v
    datasets, chunks = (), 0
    if pos + 8 <= len(data):
        chunks, length = take("<ii")
        if 0 < length <= len(data) - pos:
            datasets = (take(f"<{length}s")[0].decode("utf-8", "replace"),)
    return Imatrix(values, datasets, chunks, 0)


def ctypes_entries(llama_cpp, imatrix: Imatrix):
    """`imatrix` as the NULL-terminated `llama_model_imatrix_data` array llama_model_quantize_params
    takes. The array keeps its names and value buffers alive; keep it referenced until the call returns."""
    entry = require_binding(llama_cpp)
    array = (entry * (len(imatrix.values) + 1))()  # zero-filled: the last entry is the terminator
    keep = []
    for slot, (name, values) in zip(array, imatrix.values.items()):
        buf = np.ascontiguousarray(values, dtype=np.float32)
        keep.append(buf)
        slot.name = name.encode()
        slot.data = buf.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        slot.size = buf.size
    array._laco_keep = keep  # ctypes arrays accept attributes: the buffers live as long as the array
    return array


def require_binding(llama_cpp):
    """The binding's `llama_model_imatrix_data` struct, or an ExportError when it has none."""
    entry = getattr(llama_cpp, "llama_model_imatrix_data", None)
    if entry is None:  # older bindings declare `imatrix` as a pointer to a C++ map, which ctypes cannot build
        raise ExportError(f"llama-cpp-python {getattr(llama_cpp, '__version__', '?')} cannot pass an importance matrix "
                          "to llama.cpp's quantizer (no llama_model_imatrix_data); pip install 'llama-cpp-python>=0.3.36', "
                          "or export without an importance matrix")
    return entry
