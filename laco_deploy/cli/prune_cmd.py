"""`laco-deploy prune`: prune a dense model layer by layer and write a Hugging Face directory."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from laco_deploy.cli.app import app
from laco_deploy.cli.common import (
    AllowPickleOpt,
    TrustRemoteCodeOpt,
    BatchSizeOpt,
    CalibOpt,
    DeviceOpt,
    ModelOpt,
    OffloadOpt,
    ResumeOpt,
    SamplesOpt,
    SeedOpt,
    SeqlenOpt,
    ForceOpt,
    check,
    check_model_out,
    console,
    data_config,
    model_config,
)
from laco_deploy.buildconfig import sparsity_conflicts
from laco_deploy.config import PRUNABLE_LINEARS, PRUNE_METHODS, DataConfig, ModelConfig, PruneConfig

_P, _D, _M = PruneConfig(), DataConfig(), ModelConfig()


def parse_targets(text: str) -> tuple[str, ...]:
    """"q_proj, down_proj" -> ("q_proj", "down_proj"); `all` -> every prunable linear."""
    if text.strip() == "all":
        return PRUNABLE_LINEARS
    return tuple(t.strip() for t in text.split(",") if t.strip())


@app.command("prune")
def prune_command(
    out: Annotated[Path, typer.Option("--out", "-o", help="Output Hugging Face directory (written atomically; checkpoints go to OUT.ckpt while running).")],
    model: ModelOpt = _M.model,
    method: Annotated[str, typer.Option("--method", help=f"Pruning method: {', '.join(PRUNE_METHODS)}.")] = _P.method,
    sparsity: Annotated[Optional[float], typer.Option("--sparsity", help=f"Unstructured share of weights zeroed in every output row, in [0, 1). Default: {_P.sparsity} (not with --pattern or --structured, which set the share themselves).", show_default=False)] = None,
    pattern: Annotated[str | None, typer.Option("--pattern", help="N:M semi-structured sparsity, e.g. 2:4 or 4:8 (instead of --sparsity). Default: none (unstructured).")] = _P.pattern,
    structured: Annotated[float | None, typer.Option("--structured", help="Remove this share of FFN channels and KV head groups physically, e.g. 0.3 (smaller matrices). Default: none (no structured pruning).")] = _P.structured,
    structured_metric: Annotated[str, typer.Option("--structured-metric", help="Importance for --structured: wanda (|W|*||X|| summed per channel) or fluctuation (FLAP).")] = _P.structured_metric,
    structured_multiple: Annotated[int, typer.Option("--structured-multiple", help="--structured keeps a multiple of this many FFN channels per layer: 32 keeps every matrix in GGUF Q8_0/Q5_0 and ONNX int8 blocks (other widths are stored as F16), 256 fits the K-quants' blocks, 1 keeps the exact ratio.")] = _P.structured_multiple,
    targets: Annotated[str, typer.Option("--targets", help=f"Comma-separated linears to prune, or 'all' ({', '.join(PRUNABLE_LINEARS)}; embeddings and LM head are never pruned).")] = "all" if _P.targets == PRUNABLE_LINEARS else ",".join(_P.targets),
    owl: Annotated[bool, typer.Option("--owl", help="Outlier-weighted per-layer ratios (OWL) around --sparsity; one extra pass.")] = _P.owl,
    owl_lambda: Annotated[float, typer.Option("--owl-lambda", help="OWL: largest deviation of a layer's ratio from --sparsity.")] = _P.owl_lambda,
    owl_m: Annotated[float, typer.Option("--owl-m", help="OWL: outlier threshold in multiples of the mean score.")] = _P.owl_m,
    damp: Annotated[float, typer.Option("--damp", help="SparseGPT: Hessian damping as a share of its mean diagonal.")] = _P.sparsegpt_damp,
    blocksize: Annotated[int, typer.Option("--blocksize", help="SparseGPT: columns per lazy-update block.")] = _P.sparsegpt_blocksize,
    offload: OffloadOpt = _P.offload,
    batch_size: BatchSizeOpt = _P.batch_size,
    resume: ResumeOpt = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result record as JSON instead of the summary.")] = False,
    device: DeviceOpt = _M.device,
    allow_pickle: AllowPickleOpt = False,
    trust_remote_code: TrustRemoteCodeOpt = False,
    force: ForceOpt = False,
    calib: CalibOpt = _D.calib,
    samples: SamplesOpt = _D.samples,
    seqlen: SeqlenOpt = _D.seqlen,
    seed: SeedOpt = _D.seed,
) -> None:
    """Prune a model with magnitude, Wanda or SparseGPT (unstructured, N:M or structured).

    One decoder layer at a time is on the device; each layer is pruned from the outputs of its
    already pruned predecessors. Writes safetensors, the tokenizer and sparsity.json.
    """
    from laco_deploy.checked import check as check_boundary
    from laco_deploy.prune import run_checked

    check(sparsity_conflicts({"sparsity": sparsity, "pattern": pattern, "structured": structured}))
    mcfg = model_config(model, device, allow_pickle, trust_remote_code)
    dcfg = data_config(calib, _D.eval, samples, seqlen, _D.eval_samples, seed)
    pcfg = PruneConfig(method=method.lower(), sparsity=_P.sparsity if sparsity is None else sparsity, pattern=pattern, structured=structured,
                       structured_metric=structured_metric, structured_multiple=structured_multiple, targets=parse_targets(targets), sparsegpt_damp=damp,
                       sparsegpt_blocksize=blocksize, owl=owl, owl_lambda=owl_lambda, owl_m=owl_m, offload=offload,
                       batch_size=batch_size)
    checked = check_boundary(mcfg, dcfg, prune=pcfg)  # the stage's boundary, once, before the output checks
    check_model_out(out, force)
    result = run_checked(checked, out, resume=resume)
    if as_json:
        import json

        typer.echo(json.dumps(result.to_dict(), indent=2))
        return
    console.print(f"pruned       {result.settings['model']} with {pcfg.method}, {result.pattern}")
    console.print(f"sparsity     {result.sparsity:.2%} realised over the pruned matrices")
    console.print(f"time         {result.wall_s:.1f} s")
    console.print(f"peak memory  {result.peak_mib:.0f} MiB ({result.memory_kind})")
    console.print(f"written to   {result.model_dir}")
    for note in result.notes:
        console.print(f"note         {note}")
