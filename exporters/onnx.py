"""ONNX export of a Hugging Face decoder with KV cache.

    export(model_dir, out_dir, "fp32" | "fp16" | "int8", sparse_storage=False, check=None) -> ExportResult

The runtime check against PyTorch in onnxruntime is the caller's (`check=`, see
laco_deploy.runtimes.parity.onnx_parity), so this module runs no model itself.

The output folder is laid out like optimum's ONNX exports, so `ORTModelForCausalLM` can open it:

    model.onnx               the graph (small tensors inline)
    model.onnx_data          the weights (external data, always: see _save)
    model.sparse.safetensors (with sparse storage) compact weights; see exporters.onnx_sparse
    config.json, generation_config.json, tokenizer files
    genai_config.json        for onnxruntime-genai, where the model shape allows (exporters.onnx_genai)

optimum-onnx requires transformers < 5, so the graph comes from torch.onnx (exporters.onnx_graph)
with optimum's names; laco_deploy.runtimes.onnxrt.OrtDecoder is the matching generate loop.
Types: fp32; fp16 (weights, activations and the KV cache in half precision, logits fp16);
int8 (MatMul weights in 8-bit blocks of 32 with an fp32 scale each, onnxruntime's MatMulNBits;
embeddings, norms and the KV cache stay fp32; needs onnxruntime >= 1.22).
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from exporters.onnx_genai import write_genai_config
from laco_deploy import families
from laco_deploy.artifacts import ExportResult
from laco_deploy.errors import ExportError, LacoError
from laco_deploy.fsutil import atomic_dir
from laco_deploy.memory import release_memory
from laco_deploy.targets import ONNX

log = logging.getLogger(__name__)

MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx_data"
INT8_BLOCK = 32  # int8 weights: input-dimension block sharing one scale
_COPIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
           "special_tokens_map.json", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")


def export(model_dir: Path, out_dir: Path, quant: str, *, sparse_storage: bool = False,
           metadata: dict | None = None, check: Any | None = None) -> ExportResult:
    """Export `model_dir` to the folder `out_dir` (written atomically).

    `check`: the runtime parity check in two phases (targets.ONNX passes
    laco_deploy.runtimes.parity.onnx_parity): `check.reference(model, tokenizer)` runs while the
    PyTorch model is loaded, `check.compare(reference, tokenizer, folder)` on the finished folder
    before it is renamed into place, after the PyTorch model is released, so the two never
    share memory."""
    t0 = time.perf_counter()
    model_dir, out_dir, quant = Path(model_dir), Path(out_dir), str(quant).lower()
    _check_request(model_dir, out_dir, quant)
    model, tokenizer, config = _load(model_dir)
    notes: list[str] = []
    log.info("exporting %s to ONNX %s in %s (sparse storage: %s)", model_dir, quant, out_dir, sparse_storage)
    reference = check.reference(model, tokenizer) if check is not None else None
    with atomic_dir(out_dir) as tmp:
        proto = _build_graph(model, quant, notes, tmp / MODEL_FILE)
        del model  # on the meta device now: its weights are in the graph's data file
        release_memory()  # hand the tracer's freed blocks back before onnxruntime loads the weights again
        _add_metadata(proto, config, quant, sparse_storage, metadata)
        dense_bytes = _save(proto, tmp / MODEL_FILE)
        del proto  # the weights are on disk now; the check and sparse storage read them back from there
        checks: dict[str, Any] = {"onnx_checker": _run_checker(tmp / MODEL_FILE)}
        if sparse_storage:
            checks["storage"] = _store_sparse(tmp, dense_bytes, notes)
        _copy_side_files(model_dir, tmp, tokenizer)
        notes += write_genai_config(tmp, sparse_storage=sparse_storage)
        if check is not None:
            log.info("checking the export against PyTorch in onnxruntime")
            checks.update(check.compare(reference, tokenizer, tmp))
        size = model_bytes(tmp)
        tmp.chmod(0o755)  # mkdtemp made it private; an export folder is meant to be shared
    if getattr(config, "laco_layer_widths", None):
        ffn = sorted({w["intermediate_size"] for w in config.laco_layer_widths})
        notes.append(f"structured widths exported: FFN sizes {ffn} (dense {config.intermediate_size})")
    return ExportResult(target=ONNX.name, quant=quant, path=str(out_dir), size_bytes=size, checks=checks, notes=notes,
                        wall_s=round(time.perf_counter() - t0, 2))


def model_bytes(folder: Path) -> int:
    """Bytes of the files holding the graph and weights (tokenizer and configs not counted)."""
    from exporters.onnx_sparse import SPARSE_FILE

    return sum((folder / n).stat().st_size for n in (MODEL_FILE, DATA_FILE, SPARSE_FILE) if (folder / n).is_file())


def _check_request(model_dir: Path, out_dir: Path, quant: str) -> None:
    if quant not in ONNX.quant_types:
        raise ExportError(f"ONNX type {quant!r} is not supported; choose one of {', '.join(ONNX.quant_types)} (export.quant)")
    cfg_file = model_dir / "config.json"
    if not cfg_file.is_file():
        raise ExportError(f"{model_dir} is not a Hugging Face model directory (no config.json); pass a folder written by prune/compensate, or 'default'")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ExportError(f"{cfg_file} is not valid JSON ({e.msg}); re-save the model") from e
    archs = raw.get("architectures") or [raw.get("model_type")]
    if not any(a in families.ARCHITECTURES or a in families.MODEL_TYPES for a in archs):
        raise ExportError(f"cannot export architecture {', '.join(map(str, archs))} to ONNX; supported: "
                          f"{', '.join(families.ARCHITECTURES)}: pass a model of one of these families")
    if out_dir.is_file():
        raise ExportError(f"{out_dir} is a file; the ONNX export writes a folder: pass a folder path")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / MODEL_FILE).is_file():
        raise ExportError(f"{out_dir} is a non-empty folder that is not an ONNX export; refusing to replace it: choose another output folder")


def _load(model_dir: Path):
    from laco_deploy.models import load_model

    try:
        loaded = load_model(str(model_dir))
    except LacoError as e:
        raise ExportError(f"cannot export {model_dir}: {e}") from e
    return loaded.model.float().eval(), loaded.tokenizer, loaded.model.config


def _build_graph(model, quant: str, notes: list[str], path: Path):
    """Trace the model in the requested precision into `path` (+ its data file) -> onnx.ModelProto:
    the graph with its weights on disk (int8: quantized, its weights in memory). Consumes `model`:
    it is on the meta device afterwards (onnx_graph.trace)."""
    import onnx

    from exporters.onnx_graph import trace

    if quant == "fp16":
        model.half()  # in place: the fp32 model is not needed once the parity reference is taken
    log.info("tracing %s with torch.onnx.export(dynamo=True) on the meta device", type(model).__name__)
    try:
        proto = trace(model, path, DATA_FILE)
    except OSError:
        raise  # a full disk or an unwritable folder: the caller's message names it
    except Exception as e:  # torch.export raises many internal error types
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise ExportError(f"torch.onnx.export failed for {type(model).__name__} ({first}); "
                          "check the model loads in transformers and report the architecture") from e
    if quant == "int8":  # onnxruntime's quantizer works on the whole model in memory
        onnx.load_external_data_for_model(proto, str(path.parent))
        proto = _quantize_int8(proto, notes)
    if quant == "fp16":
        notes.append("fp16: weights, activations, KV cache and logits in half precision (RMSNorm computes in fp32 "
                     "inside the graph); meant for GPUs, onnxruntime's CPU provider lacks fast fp16 kernels for many ops")
    return proto


def _quantize_int8(proto, notes: list[str]):
    """8-bit weights for every constant-weight MatMul: blocks of INT8_BLOCK along the input
    dimension with one fp32 scale each (symmetric, like GGUF q8_0), run by onnxruntime's
    MatMulNBits with int8 activation compute per block (accuracy_level 4).

    Per-tensor dynamic activation quantization (quantize_dynamic / MatMulInteger) was tried
    first: the outlier channels of LLM activations wreck it (top-1 67% on SmolLM2-135M)."""
    import onnxruntime
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        MatMulNBitsQuantizer,
    )

    if tuple(int(x) for x in onnxruntime.__version__.split(".")[:2]) < (1, 22):
        raise ExportError(f"ONNX int8 needs onnxruntime >= 1.22 (8-bit MatMulNBits); this is {onnxruntime.__version__}: "
                          "pip install -U onnxruntime, or export fp32/fp16")
    cfg = DefaultWeightOnlyQuantConfig(block_size=INT8_BLOCK, is_symmetric=True, accuracy_level=4, bits=8)
    quantizer = MatMulNBitsQuantizer(proto, bits=8, block_size=INT8_BLOCK, is_symmetric=True, accuracy_level=4,
                                     algo_config=cfg)
    qlog = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")
    level, qlog.level = qlog.level, logging.WARNING  # it logs every node at INFO
    try:
        quantizer.process()
    finally:
        qlog.setLevel(level)
    out = quantizer.model.model
    kinds = [n.op_type for n in out.graph.node]
    notes.append(f"int8: {kinds.count('MatMulNBits')} MatMul weights in 8-bit blocks of {INT8_BLOCK} with an fp32 scale "
                 f"each (symmetric, like GGUF q8_0; onnxruntime MatMulNBits, int8 activation compute per block); "
                 f"embeddings, a tied output head, norms and the KV cache stay fp32")
    return out


def _save(proto, path: Path) -> int:
    """Write the graph to `path` and its weights (tensors over 1 KiB) to DATA_FILE beside it -> bytes
    written. A proto whose weights are already in DATA_FILE (as traced) is written without them;
    one holding its weights in memory gives them up to the file (onnx moves them out of `proto`).

    Always external data, as optimum does above 2 GB: no protobuf size limit, and onnxruntime
    loads it faster with a lower peak RSS (measured on SmolLM2-135M fp32: 1.5 s and 0.71 GiB
    against 2.4 s and 0.92 GiB for the single-file form)."""
    import onnx

    from exporters.onnx_graph import WEIGHT_INLINE_BYTES

    data = path.parent / DATA_FILE
    if _holds_weights(proto):
        data.unlink(missing_ok=True)  # onnx appends to an existing data file
        onnx.save_model(proto, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=data.name, size_threshold=WEIGHT_INLINE_BYTES)
    else:
        onnx.save_model(proto, str(path))
    return path.stat().st_size + (data.stat().st_size if data.is_file() else 0)


def _holds_weights(proto) -> bool:
    """Whether some tensor over the inline size still has its bytes inside `proto`."""
    import onnx

    from exporters.onnx_graph import WEIGHT_INLINE_BYTES

    tensors = list(proto.graph.initializer) + [a.t for n in proto.graph.node for a in n.attribute if a.HasField("t")]
    return any(t.data_location != onnx.TensorProto.EXTERNAL and t.ByteSize() > WEIGHT_INLINE_BYTES for t in tensors)


def _run_checker(path: Path) -> str:
    import onnx

    try:
        onnx.checker.check_model(str(path), full_check=False)
    except onnx.checker.ValidationError as e:
        raise ExportError(f"onnx.checker rejected the exported graph ({str(e).splitlines()[0][:200]}); report the model architecture") from e
    return "passed"


def _add_metadata(proto, config, quant: str, sparse: bool, extra: dict | None) -> None:
    """metadata_props: laco_deploy.* = how the model was made (pruning/compensation, widths, type)."""
    from laco_deploy import __version__

    props: dict[str, Any] = {"laco_deploy.version": __version__, "laco_deploy.quant": quant,
                             "laco_deploy.sparse_storage": sparse, "laco_deploy.torch": torch.__version__}
    for key, value in (getattr(config, "laco_deploy", None) or {}).items():
        props[f"laco_deploy.{key}"] = value
    if getattr(config, "laco_layer_widths", None):
        props["laco_deploy.layer_widths"] = config.laco_layer_widths
    props.update(extra or {})
    del proto.metadata_props[:]
    for key, value in props.items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = str(key), value if isinstance(value, str) else json.dumps(value, default=str)


def _store_sparse(tmp: Path, dense_bytes: int, notes: list[str]) -> dict:
    """Rewrite model.onnx with compressed weights; measure it against the dense file just written."""
    import onnx

    from exporters.onnx_sparse import DENSE_FILE, SPARSE_FILE, compress, densify

    proto = onnx.load(str(tmp / MODEL_FILE))  # with its weights: compress reads and rewrites them
    stats = compress(proto, tmp)
    _save(proto, tmp / MODEL_FILE)
    sparse_bytes = model_bytes(tmp)
    if stats["tensors_compressed"]:  # the rewritten graph must pass the checker once densified
        densify(tmp)
        stats["onnx_checker_densified"] = _run_checker(tmp / MODEL_FILE)
        (tmp / DENSE_FILE).unlink()
    stats.update({"dense_bytes": dense_bytes, "sparse_bytes": sparse_bytes, "ratio": round(sparse_bytes / dense_bytes, 4)})
    if stats["tensors_compressed"]:
        notes.append(f"sparse storage: {stats['tensors_compressed']} weights as bitmask + non-zeros in {SPARSE_FILE}: "
                     f"{sparse_bytes / 2**20:.1f} MiB against {dense_bytes / 2**20:.1f} MiB dense (measured). Loading densifies "
                     f"them (onnxruntime runs dense kernels: no speed-up); other loaders need exporters.onnx_sparse.densify(folder), "
                     f"which writes {DENSE_FILE}")
    else:
        notes.append("sparse storage: no weight is sparse enough to shrink (need over ~15% zeros); stored dense")
    return stats


def _copy_side_files(model_dir: Path, tmp: Path, tokenizer) -> None:
    """config.json, generation_config.json and the tokenizer, as optimum's exports carry them."""
    tokenizer.save_pretrained(tmp)
    for name in _COPIED:
        if (model_dir / name).is_file():
            shutil.copy2(model_dir / name, tmp / name)
