"""`laco-deploy export`: write a Hugging Face model directory as GGUF (llama.cpp) or ONNX (onnxruntime)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from laco_deploy.cli.app import app
from laco_deploy.cli.common import ForceOpt, check, console
from laco_deploy.config import DEFAULT_MODEL, IMATRIX_CALIB, DataConfig, ExportConfig
from laco_deploy.targets import TARGETS, quant_help, target_help


@app.command("export")
def export_command(
    model: Annotated[str, typer.Option("--model", "-m", help=f"Model to export: a Hugging Face directory (e.g. a pruned or compensated one), a .gguf file, a hub id or '{DEFAULT_MODEL}'.")] = DEFAULT_MODEL,
    target: Annotated[str, typer.Option("--target", "-t", help=f"{target_help()}.")] = ExportConfig.target,
    quant: Annotated[Optional[str], typer.Option("--quant", help=f"Weight type. {quant_help()}.")] = None,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Output .gguf file, or ONNX output folder. Default: in the current folder, named after the model and the type.")] = None,
    force: ForceOpt = False,
    sparse_storage: Annotated[bool, typer.Option("--sparse-storage", help="ONNX: store sparse weights compactly (loading densifies them; no speed-up).")] = ExportConfig.sparse_storage,
    imatrix: Annotated[Optional[str], typer.Option("--imatrix", help=f"GGUF k-quants: an importance-matrix file (from `laco-deploy imatrix` or llama.cpp's llama-imatrix) that weights each column's rounding error, as `llama-quantize --imatrix` does; '{IMATRIX_CALIB}' computes it on the model from the default calibration text first (written next to the output).")] = None,
) -> None:
    """Export a model for an edge runtime, then check it against PyTorch.

    GGUF goes through the `gguf` package's writer (k-quants through llama.cpp's own quantizer);
    ONNX is a decoder with KV cache whose input/output names match optimum's ORTModelForCausalLM.
    """
    cfg = ExportConfig(target=target.lower(), quant=quant, sparse_storage=sparse_storage,
                       imatrix=imatrix)
    check(cfg.validate())
    from laco_deploy.modelcheck import check_shapes
    from laco_deploy.models import HF_DIR, check_source, local_dir, output_stem

    target = TARGETS[cfg.target]
    source = check_source(model, allow_pickle=None, trust_remote_code=None)  # before a GGUF is converted or anything loads
    if source.kind == HF_DIR:
        check_shapes(source.path)  # a tensor of the wrong shape fails here, not halfway through writing
    dest = out or Path(target.artifact_name(output_stem(source), cfg.resolved_quant))
    target.check_out(dest, "--out", force=force, force_option="--force")
    weights = Path(imatrix) if imatrix not in (None, IMATRIX_CALIB) else None
    imatrix_out = dest.with_suffix(".imatrix.gguf")
    if imatrix == IMATRIX_CALIB and cfg.resolved_quant in target.imatrix_quants:
        target.check_out(imatrix_out, "--out", force=force, force_option="--force")  # written beside --out
    model_dir = local_dir(source)
    from laco_deploy.imatrix import compute, trained_with

    if imatrix == IMATRIX_CALIB and cfg.resolved_quant in target.imatrix_quants:
        weights = trained_with(model_dir)  # QA-LaCo's own: the export reproduces the grid it trained through
        if weights is not None:
            console.print(f"importance matrix QA-LaCo trained {model_dir.name} through: {weights}")
        else:
            weights = Path(compute(model_dir, DataConfig(), imatrix_out).path)
            console.print(f"importance matrix of {model_dir.name} on {DataConfig.calib}: {weights}")
    if imatrix is None and cfg.resolved_quant in target.imatrix_quants and trained_with(model_dir) is not None:
        console.print(f"note: {model_dir.name} was trained through llama.cpp's importance-weighted quantizer (its "
                      f"imatrix.gguf); without --imatrix {IMATRIX_CALIB} the file holds another grid than the one trained through")
    result = target.export(model_dir, dest, cfg.resolved_quant, sparse_storage=cfg.sparse_storage, imatrix=weights)
    console.print(f"wrote {result.path} ({result.size_bytes / 2**20:.1f} MiB, {result.target} {result.quant})")
    for key, value in result.checks.items():
        console.print(f"  {key}: {value}")
    for note in result.notes:
        console.print(f"  note: {note}")
