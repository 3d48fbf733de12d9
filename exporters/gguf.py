"""GGUF export through the `gguf` package's writer; k-quants through llama.cpp's own quantizer.

    export(model_dir, out_path, quant) -> ExportResult

F32, F16, BF16 and Q8_0 are written directly (norms and 1-D tensors stay F32, as llama.cpp's
converter does; a Q8_0 tensor whose rows are not a multiple of 32 falls back to F16). Q4_K_M,
Q5_K_M and Q6_K are made by writing an F32 file next to the output and running
`llama_cpp.llama_model_quantize` on it, with an importance matrix when given (`imatrix=`, a file in
llama.cpp's format: exporters.gguf_imatrix). The file appears only when complete (atomic rename).
Tensors are declared from the safetensors headers first, then read, quantized and written one at a
time, so the export never holds a second copy of the model. Right after writing, the file is read
back, then handed to the caller's runtime check (`check=`: llama.cpp against PyTorch).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, NamedTuple

import gguf
import numpy as np

from exporters import gguf_imatrix, gguf_model, gguf_vocab
from exporters.gguf_imatrix import Imatrix
from exporters.gguf_names import EXPORTER_KEY, F32_SUFFIXES, LACO_PREFIX, QUANTS, QuantSpec
from laco_deploy import __version__
from laco_deploy.artifacts import SOURCE_FILE, ExportResult
from laco_deploy.errors import ExportError
from laco_deploy.fsutil import atomic_path
from laco_deploy.targets import GGUF

log = logging.getLogger(__name__)

F16 = gguf.GGMLQuantizationType.F16


def export(model_dir: Path, out_path: Path, quant: str, *, metadata: dict | None = None,
           check: Callable[[Path, Path], dict] | None = None, imatrix: Path | None = None) -> ExportResult:
    """Write `model_dir` (HF safetensors directory) as a GGUF file of type `quant`.

    `metadata` (and config.json's `laco_deploy` dict) are recorded under `laco_deploy.*` keys.
    `check(model_dir, gguf_path) -> dict`: the runtime parity check (targets.GGUF passes
    laco_deploy.runtimes.parity.gguf_parity); its results join the read-back checks.
    `imatrix`: an importance-matrix file for llama.cpp's quantizer (the types it makes; others note it unused).
    """
    t0 = time.perf_counter()
    quant = str(quant).lower()
    if quant not in QUANTS:
        raise ExportError(f"GGUF type {quant!r} is not supported; choose from {', '.join(QUANTS)}")
    model_dir, out_path = Path(model_dir), Path(out_path)
    config = gguf_model.read_config(model_dir)
    plan = gguf_model.plan_model(config)
    gguf_model.safetensor_files(model_dir)  # fail before writing anything
    laco = {**(config.get(LACO_PREFIX) or {}), **(metadata or {})}
    spec = QUANTS[quant]
    imat, imat_notes = _load_imatrix(imatrix, model_dir, plan, quant)
    if imat is not None:
        laco["imatrix"] = {"file": Path(imatrix).name, "entries": len(imat.values), "chunks": imat.chunk_count,
                           "chunk_size": imat.chunk_size, "datasets": list(imat.datasets)}
    from exporters.gguf_check import read_back

    with atomic_path(out_path) as tmp:  # published under its name only once read back and checked
        if spec.tensor_type is not None:
            notes = _write(model_dir, tmp, plan, config, spec, laco)
        else:
            with tempfile.TemporaryDirectory(prefix=f".{out_path.name}.", dir=out_path.parent) as work:
                f32 = Path(work) / "f32.gguf"
                notes = _write(model_dir, f32, plan, config, QUANTS["f32"], laco)
                _llama_quantize(f32, tmp, spec, imatrix if imat is not None else None)
        checks = read_back(tmp)
        if check is not None:
            checks.update(check(model_dir, tmp))
    if plan.per_layer:
        notes.append(f"per-layer widths: written as architecture {plan.arch_name} (llama.cpp reads per-layer "
                     "feed_forward_length and head counts)")
    return ExportResult(target=GGUF.name, quant=quant, path=str(out_path), size_bytes=out_path.stat().st_size,
                        checks=checks, notes=imat_notes + notes, wall_s=round(time.perf_counter() - t0, 2))


def _load_imatrix(path: Path | None, model_dir: Path, plan, quant: str) -> tuple[Imatrix | None, list[str]]:
    """The importance matrix to pass to llama.cpp's quantizer, checked against this model's weights
    (a name llama.cpp finds with another width aborts its quantizer), and notes for the result."""
    if path is None:
        return None, []
    if QUANTS[quant].tensor_type is not None:
        return None, [f"imatrix {Path(path).name} unused: {quant} is written without llama.cpp's quantizer "
                      "(importance weighting applies to its k-quants)"]
    imat = gguf_imatrix.read(path)
    widths = {e.name: e.shape[-1] for e in gguf_model.tensor_entries(model_dir, plan) if len(e.shape) == 2}
    used = [n for n in imat.values if n in widths]
    if not used:
        raise ExportError(f"imatrix {path} names none of {model_dir}'s weights (e.g. {next(iter(imat.values))}); "
                          "compute it on this model with `laco-deploy imatrix`")
    for name in used:
        if imat.values[name].size != widths[name]:
            raise ExportError(f"imatrix {path}: {name} has {imat.values[name].size} values but the model's tensor has "
                              f"{widths[name]} input columns (another model's imatrix?); compute it on {model_dir}")
    missing = sorted(set(widths) - set(used) - {"token_embd.weight", "output.weight"})
    notes = [f"imatrix {Path(path).name}: {len(used)} weights importance-weighted ({imat.chunk_count} chunks of "
             f"{imat.chunk_size} tokens of {', '.join(imat.datasets) or 'unnamed data'})"]
    if missing:
        notes.append(f"imatrix has no data for {len(missing)} weight(s), quantized unweighted ({missing[0]}...)")
    return imat, notes


def _write(model_dir: Path, path: Path, plan, config: dict, spec: QuantSpec, laco: dict) -> list[str]:
    """One GGUF file with tensors of `spec.tensor_type` (see module doc). Returns notes."""
    writer = gguf.GGUFWriter(str(path), plan.arch_name)
    notes: list[str] = []
    source = _source_gguf(model_dir)
    if source is not None and gguf_vocab.carry_from_gguf(writer, source, plan.n_vocab):
        notes.append(f"tokenizer and general metadata carried over from {source}")
    else:
        writer.add_type(gguf.GGUFType.MODEL)
        writer.add_name(str(config.get("_name_or_path") or config.get("_model_name_or_path") or model_dir.name))
        notes += gguf_vocab.write_hf_tokenizer(writer, model_dir, plan.n_vocab)
    gguf_model.write_hparams(writer, plan, config)
    writer.add_file_type(spec.file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_string(EXPORTER_KEY, f"laco-deploy {__version__}")  # how a rerun knows the file is its own
    _write_laco_metadata(writer, laco)
    fallbacks = _write_tensors(writer, model_dir, plan, config, spec.tensor_type)
    if fallbacks:
        notes.append(f"{len(fallbacks)} tensor(s) written as F16: rows not a multiple of the block size ({fallbacks[0]}...)")
    writer.close()
    return notes


def _write_tensors(writer, model_dir: Path, plan, config: dict, qtype) -> list[str]:
    """Declare every tensor from the checkpoint headers, write the header, metadata and tensor infos,
    then read, quantize and write the tensors one at a time: no second copy of the model is held.
    Returns the tensors written as F16 because their rows fit no `qtype` block."""
    tensors = _plan_tensors(model_dir, plan, config, qtype)
    for name, t in tensors.items():
        writer.add_tensor_info(name, *_packed_layout(t.shape, t.ttype), raw_dtype=t.ttype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in tensors.values():  # in the order of the tensor infos
        writer.write_tensor_data(gguf.quants.quantize(t.read(), t.ttype))
    return [name for name, t in tensors.items() if t.ttype == F16 and qtype != F16]


class _Planned(NamedTuple):
    shape: tuple[int, ...]  # HF [out, in] order
    ttype: Any  # gguf.GGMLQuantizationType it is stored as
    read: Callable[[], np.ndarray]  # its float32 data, read when written


def _tensor_type(name: str, shape: tuple[int, ...], qtype) -> Any:
    """What llama.cpp's converter stores: F32 for 1-D tensors and norms, F16 where the rows are not a
    multiple of `qtype`'s block size, else `qtype`."""
    if len(shape) <= 1 or name.endswith(F32_SUFFIXES):
        return gguf.GGMLQuantizationType.F32
    if shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
        return F16
    return qtype


def _plan_tensors(model_dir: Path, plan, config: dict, qtype) -> dict[str, _Planned]:
    """GGUF name -> _Planned for every tensor, in file order, from the checkpoint headers alone."""
    tensors = {name: _Planned(data.shape, _tensor_type(name, data.shape, qtype), lambda data=data: data)
               for name, data in gguf_model.extra_tensors(plan, config)}
    for e in gguf_model.tensor_entries(model_dir, plan):
        tensors[e.name] = _Planned(e.shape, _tensor_type(e.name, e.shape, qtype), functools.partial(gguf_model.read_tensor, e))
    if plan.tied is False and "output.weight" not in tensors:
        raise ExportError(f"{model_dir}: tie_word_embeddings is false but lm_head.weight is missing; re-save the model")
    return tensors


def _packed_layout(shape: tuple[int, ...], ttype) -> tuple[tuple[int, ...], np.dtype, int]:
    """(shape, dtype, bytes) of gguf.quants.quantize's output for a float32 tensor of `shape`."""
    if ttype in (gguf.GGMLQuantizationType.F32, F16):
        dtype = np.dtype(np.float32 if ttype == gguf.GGMLQuantizationType.F32 else np.float16)
        return tuple(shape), dtype, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    packed = gguf.quants.quant_shape_to_byte_shape(shape, ttype)
    return packed, np.dtype(np.uint8), int(np.prod(packed, dtype=np.int64))


def _source_gguf(model_dir: Path) -> Path | None:
    """The GGUF file this directory was converted from, if it says so and the file still exists."""
    marker = model_dir / SOURCE_FILE
    if not marker.is_file():
        return None
    try:
        path = Path(json.loads(marker.read_text())["gguf"])
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ExportError(f"{marker} is malformed ({e}); delete it to build the tokenizer from the HF files") from e
    if not path.is_file():
        log.warning("%s names %s, which no longer exists; building the tokenizer from the HF files", marker, path)
        return None
    return path


def _write_laco_metadata(writer: gguf.GGUFWriter, values: dict[str, Any], prefix: str = LACO_PREFIX) -> None:
    """Flatten nested settings into `laco_deploy.a.b` keys with natural GGUF types."""
    for key, value in values.items():
        full = f"{prefix}.{key}"
        if isinstance(value, dict):
            _write_laco_metadata(writer, value, full)
        elif isinstance(value, bool):
            writer.add_bool(full, value)
        elif isinstance(value, int):
            writer.add_int64(full, value)
        elif isinstance(value, float):
            writer.add_float64(full, value)
        elif isinstance(value, str):
            if value:
                writer.add_string(full, value)
        elif isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
            writer.add_array(full, list(value))
        elif value is not None:
            writer.add_string(full, json.dumps(value))


def _llama_quantize(src: Path, dst: Path, spec: QuantSpec, imatrix: Path | None = None) -> None:
    """Quantize an F32 GGUF with llama.cpp's own k-quant recipes (llama-cpp-python binding), weighting
    each column's rounding error by the importance matrix in the file `imatrix` when given (as
    `llama-quantize --imatrix` does). The call runs in a child process (llama_quantize_job.py): one C
    call of tens of seconds would otherwise hold off Ctrl-C; an interrupt here ends the child at once."""
    try:
        import llama_cpp
    except ImportError as e:
        raise ExportError("k-quants need llama-cpp-python: pip install llama-cpp-python (or export q8_0/f16)") from e
    if imatrix is not None:
        gguf_imatrix.require_binding(llama_cpp)
    # the child imports what this process imports (an editable or PYTHONPATH checkout), never the working folder's
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "PYTHONSAFEPATH": "1"}
    cmd = [sys.executable, "-m", "exporters.llama_quantize_job", str(src), str(dst), spec.llama_ftype]
    proc = subprocess.run(cmd + ([str(imatrix)] if imatrix is not None else []), env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, check=False)
    if proc.returncode != 0:
        why = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        raise ExportError(f"llama.cpp's quantizer failed ({why}) making {spec.llama_ftype} from {src}; try export.quant q8_0")


def tensor_types(path: Path) -> dict[str, int]:
    """How many tensors of each GGML type a GGUF file holds (e.g. {"Q4_K": 120, "F32": 61})."""
    reader = gguf.GGUFReader(str(path), "r")
    return dict(Counter(t.tensor_type.name for t in reader.tensors))
