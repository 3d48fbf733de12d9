"""`laco-deploy imatrix`: the importance matrix of a model for llama.cpp's quantizer (`export --imatrix`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Optional

import typer

from laco_deploy.cli.app import app
from laco_deploy.cli.common import (
    BatchSizeOpt,
    CalibOpt,
    DeviceOpt,
    ForceOpt,
    ModelOpt,
    SamplesOpt,
    SeedOpt,
    SeqlenOpt,
    console,
    data_config,
    model_config,
)
from laco_deploy.config import DataConfig, ModelConfig, PruneConfig
from laco_deploy.fsutil import check_output

_D, _M = DataConfig(), ModelConfig()


@app.command("imatrix")
def imatrix_command(
    model: ModelOpt = _M.model,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Output file (llama.cpp's GGUF imatrix format). Default: next to the model, MODEL.imatrix.gguf.")] = None,
    calib: CalibOpt = _D.calib,
    samples: SamplesOpt = _D.samples,
    seqlen: SeqlenOpt = _D.seqlen,
    seed: SeedOpt = _D.seed,
    batch_size: BatchSizeOpt = PruneConfig.batch_size,
    device: DeviceOpt = _M.device,
    force: ForceOpt = False,
) -> None:
    """Compute llama.cpp's importance matrix of a model on the calibration text.

    Per input column of every weight matrix in the decoder layers: the mean squared input over the
    calibration tokens, as llama-imatrix computes it. Pass the file to `export --imatrix` (or to
    llama.cpp's `llama-quantize --imatrix`) so the k-quants weight each column's rounding error by it.
    """
    from laco_deploy.imatrix import compute
    from exporters.gguf_check import written_here
    from laco_deploy.models import HF_DIR, check_source, local_dir, resolve_device

    mcfg = model_config(model, device, False)
    dcfg = data_config(calib, _D.eval, samples, seqlen, _D.eval_samples, seed)
    source = check_source(mcfg.model, allow_pickle=None, trust_remote_code=None, seqlen=dcfg.seqlen)
    local = Path(os.path.abspath(source.path)) if source.kind == HF_DIR else None
    dest = out or (local.parent / f"{local.name}.imatrix.gguf" if local else None)
    check_output(dest, "--out", force=force, kind="file", made_here=written_here, force_option="--force")
    model_dir = local_dir(source)
    dest = dest or model_dir.parent / f"{model_dir.name}.imatrix.gguf"  # beside a converted GGUF in the cache
    res = compute(model_dir, dcfg, dest, device=resolve_device(mcfg.device), batch_size=batch_size)
    console.print(f"wrote {res.path}: {res.entries} weight matrices, {res.samples} x {res.seqlen} tokens of {res.calib} "
                  f"({res.wall_s:.0f} s)")
