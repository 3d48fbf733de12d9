"""Compact storage of sparse ONNX weights: a bitmask plus the packed non-zero values.

Why not ONNX sparse initializers: the standard stores int64 indices per non-zero, so a 50%
sparse fp32 matrix takes 0.5 x (4 + 8) = 6 bytes per element against 4 dense, i.e. it grows.
A bitmask costs 1 bit per element: 0.5 x 4 + 1/8 = 2.1 bytes (fp32), 1.1 (fp16), 0.6 (int8).

Layout of an export folder written with sparse storage:

    model.onnx                the graph; each compressed weight is an external-data tensor that
                              points into `model.densified.bin` (offset, length), a file that is
                              NOT shipped
    model.sparse.safetensors  per compressed weight `<name>/values` (non-zeros, row-major order)
                              and `<name>/mask` (np.packbits of `weight != fill`); metadata says
                              the shapes, dtypes, fill values (0; 128 for 8-bit codes) and offsets

Loading densifies: `external_initializers()` rebuilds the dense arrays in memory and
laco_deploy.runtimes.onnxrt passes them to onnxruntime (`add_external_initializers`); any other
loader (optimum, plain onnxruntime) needs `densify(folder)` first, which writes the missing
`model.densified.bin`. onnxruntime runs dense kernels either way: smaller files, no speed-up.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from laco_deploy.errors import ExportError, RuntimeBackendError
from laco_deploy.fsutil import atomic_path

SPARSE_FILE = "model.sparse.safetensors"
DENSE_FILE = "model.densified.bin"
FORMAT = "laco-deploy-sparse/1"
MIN_SAVING = 0.10  # compress a weight only when the packed form is at least 10% smaller
_ALIGN = 64  # byte alignment of tensors inside the densified file


def packed_bytes(n_elements: int, n_nonzero: int, itemsize: int) -> int:
    """Bytes of the bitmask form: the non-zero values plus one bit per element."""
    return n_nonzero * itemsize + math.ceil(n_elements / 8)


def fill_value(array: np.ndarray) -> np.generic:
    """The value pruned weights hold: 0 for floats; for integer codes the most frequent one
    (8-bit MatMulNBits stores symmetric weights as uint8 with zero at 128)."""
    if array.dtype.kind not in "iu" or array.dtype.itemsize != 1:
        return array.dtype.type(0)
    counts = np.bincount(array.reshape(-1).view(np.uint8), minlength=256)
    return np.array([int(counts.argmax())], dtype=np.uint8).view(array.dtype)[0]


def pack(array: np.ndarray, fill=0) -> tuple[np.ndarray, np.ndarray]:
    """array (any shape) -> (values [n_kept] same dtype, mask [ceil(n/8)] uint8 bits of array != fill)."""
    flat = np.ascontiguousarray(array).reshape(-1)
    keep = flat != fill
    return flat[keep].copy(), np.packbits(keep)


def unpack(values: np.ndarray, mask: np.ndarray, shape: tuple[int, ...], fill=0) -> np.ndarray:
    """Inverse of `pack`: scatter the values into `fill` at the mask's set bits -> array of `shape`."""
    n = int(np.prod(shape, dtype=np.int64))
    keep = np.unpackbits(mask, count=n).astype(bool)
    if int(keep.sum()) != values.size:
        raise RuntimeBackendError(f"sparse container is corrupt: mask has {int(keep.sum())} set bits for {values.size} values; re-export with export.sparse_storage")
    dense = np.full(n, fill, dtype=values.dtype)
    dense[keep] = values
    return dense.reshape(shape)


def compress(proto, folder: Path) -> dict[str, Any]:
    """Move the weights of `proto` that are sparse enough into `folder/SPARSE_FILE`; rewrite them
    in `proto` as external tensors pointing into DENSE_FILE. Returns counts for the report."""
    from onnx import TensorProto, numpy_helper
    from safetensors.numpy import save_file

    tensors: dict[str, np.ndarray] = {}
    index: dict[str, dict[str, Any]] = {}
    offset, zeros, elements = 0, 0, 0
    for init in proto.graph.initializer:
        if len(init.dims) < 2 or init.data_location == TensorProto.EXTERNAL:
            continue
        array = numpy_helper.to_array(init)
        fill = fill_value(array)
        nnz = int(np.count_nonzero(array != fill))
        if packed_bytes(array.size, nnz, array.itemsize) > (1 - MIN_SAVING) * array.nbytes:
            continue
        tensors[f"{init.name}/values"], tensors[f"{init.name}/mask"] = pack(array, fill)
        index[init.name] = {"shape": list(array.shape), "dtype": str(array.dtype), "fill": fill.item(),
                            "offset": offset, "length": array.nbytes}
        _make_external(init, offset, array.nbytes)
        offset += -(-array.nbytes // _ALIGN) * _ALIGN
        zeros += array.size - nnz
        elements += array.size
    if tensors:
        with atomic_path(folder / SPARSE_FILE) as tmp:
            save_file(tensors, str(tmp), metadata={"format": FORMAT, "dense_file": DENSE_FILE, "tensors": json.dumps(index)})
        os.chmod(folder / SPARSE_FILE, 0o644)  # a shipped artifact, readable like model.onnx
    return {"tensors_compressed": len(index), "zero_fraction": round(zeros / elements, 4) if elements else 0.0,
            "dense_weight_bytes": offset}


def _make_external(init, offset: int, length: int) -> None:
    from onnx import TensorProto

    for field in ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
        init.ClearField(field)
    init.data_location = TensorProto.EXTERNAL
    del init.external_data[:]
    for key, value in (("location", DENSE_FILE), ("offset", str(offset)), ("length", str(length))):
        entry = init.external_data.add()
        entry.key, entry.value = key, value


def _read_container(folder: Path) -> tuple[dict[str, np.ndarray], dict[str, dict[str, Any]]]:
    from safetensors import safe_open

    path = folder / SPARSE_FILE
    try:
        with safe_open(str(path), framework="numpy") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT:
                raise RuntimeBackendError(f"{path} has format {meta.get('format')!r}, expected {FORMAT}; re-export with export.sparse_storage")
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is no dict)
        return tensors, json.loads(meta["tensors"])
    except (OSError, KeyError, ValueError) as e:
        raise RuntimeBackendError(f"cannot read the sparse container {path}: {e}; re-export with export.sparse_storage") from e


def needs_densify(folder: Path) -> bool:
    """True when the folder holds a sparse container whose dense file has not been written."""
    folder = Path(folder)
    return (folder / SPARSE_FILE).is_file() and not (folder / DENSE_FILE).is_file()


def external_initializers(folder: Path) -> dict[str, np.ndarray]:
    """The compressed weights of an export folder, densified in memory: {initializer name: array}."""
    tensors, index = _read_container(Path(folder))
    out = {}
    for name, info in index.items():
        arr = unpack(tensors[f"{name}/values"], tensors[f"{name}/mask"], tuple(info["shape"]), info.get("fill", 0))
        if str(arr.dtype) != info["dtype"]:
            raise RuntimeBackendError(f"sparse container: {name} holds {arr.dtype}, index says {info['dtype']}; re-export with export.sparse_storage")
        out[name] = arr
    return out


def densify(folder: Path) -> Path:
    """Write the dense weights file that model.onnx points to, so any ONNX loader can open the
    folder (e.g. optimum's ORTModelForCausalLM). Returns the written file."""
    folder = Path(folder)
    if not (folder / SPARSE_FILE).is_file():
        raise ExportError(f"{folder} has no {SPARSE_FILE}; densify applies only to exports written with export.sparse_storage")
    _, index = _read_container(folder)
    arrays = external_initializers(folder)
    target = folder / DENSE_FILE
    with atomic_path(target) as tmp, open(tmp, "wb") as f:
        for name, info in sorted(index.items(), key=lambda kv: kv[1]["offset"]):
            f.seek(info["offset"])
            f.write(np.ascontiguousarray(arrays[name]).tobytes())
    return target
