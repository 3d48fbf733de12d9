"""`laco-deploy plan`: predict each build stage's peak host and device memory from the model's config."""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer

from laco_deploy.cli.app import app
from laco_deploy.cli.common import (
    DeviceOpt,
    OffloadOpt,
    EvalSamplesOpt,
    ModelOpt,
    SamplesOpt,
    SeqlenOpt,
    TrustRemoteCodeOpt,
    check,
    console,
    data_config,
)
from laco_deploy.config import BuildConfig, CompensateConfig, DataConfig, ModelConfig, PruneConfig

_D, _M, _P = DataConfig(), ModelConfig(), PruneConfig()
MIB = 2**20


@app.command("plan")
def plan_command(
    model: ModelOpt = _M.model,
    offload: OffloadOpt = _P.offload,
    samples: SamplesOpt = _D.samples,
    seqlen: SeqlenOpt = _D.seqlen,
    eval_samples: EvalSamplesOpt = _D.eval_samples,
    device: DeviceOpt = "cpu",
    trust_remote_code: TrustRemoteCodeOpt = False,
    size: Annotated[Optional[str], typer.Option("--size", help="Also show what `build --size` would choose for this model within this file-size budget (e.g. 90MiB), with the candidates and why, without building.", show_default=False)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the estimates as JSON.")] = False,
) -> None:
    """Predict the peak memory of each stage of `laco-deploy build` for a model, before running it.

    Reads the model's config only (no weights): per stage the peak resident memory of the process
    (RSS) and, for a CUDA run, the peak device memory (one decoder layer, or a pair, with its
    training state and activations). Checked against measured peaks by benchmarks/scale_bench.py.
    With --size, also the configuration `build --size` would choose for this model, and why.
    """
    import torch

    from laco_deploy.budget import choose, explain, parse_size, shape_of
    from laco_deploy.memplan import Workload, estimate_build
    from laco_deploy.sizing import model_bytes
    from laco_deploy.models import check_source, local_model_dir

    if size is not None:
        parse_size(size)  # a nonsense budget fails before the model is read
    data = data_config(_D.calib, _D.eval, samples, seqlen, eval_samples, _D.seed)
    cfg = BuildConfig(data=data, prune=PruneConfig(offload=offload), compensate=CompensateConfig(offload=offload))
    check(cfg.validate())
    check_source(model, allow_pickle=True, trust_remote_code=trust_remote_code, seqlen=seqlen)  # reads no weights: pickles are fine
    sizes = model_bytes(local_model_dir(model), trust_remote_code)
    job = Workload.of_build(cfg, torch.device("cuda" if device.startswith("cuda") else "cpu"), sizes)
    stages = estimate_build(sizes, job)
    choice = choose(size, shape_of(sizes)).record() if size is not None else None
    if as_json:
        typer.echo(json.dumps({"model": model, "weights_bytes": sizes, "workload": job.__dict__,
                               "stages": [{"stage": e.stage, "host_bytes": e.host_bytes, "device_bytes": e.device_bytes,
                                           "terms": e.terms} for e in stages], **({"size_budget": choice} if choice else {})},
                              indent=2))
        return
    for line in explain(choice, full=True) + [""] if choice else ():
        console.print(line, highlight=False, soft_wrap=True)
    console.print(f"model        {model}: {sizes['total'] / 4 / 1e6:.0f} M parameters, {sizes['total'] / MIB:.0f} MiB in fp32")
    console.print(f"             {sizes['num_layers']} decoder layers, the largest {sizes['layer_max'] / MIB:.1f} MiB; offload {offload}")
    console.print(f"{'stage':<12} {'RAM MiB':>8} {'GPU MiB':>8}  largest parts (MiB)")
    for e in stages:
        top = sorted(e.terms.items(), key=lambda kv: -kv[1])[:3]
        console.print(f"{e.stage:<12} {e.host_bytes / MIB:8.0f} {e.device_bytes / MIB:8.0f}  "
                      + ", ".join(f"{k} {v / MIB:.0f}" for k, v in top))
    peak = max(stages, key=lambda e: e.host_bytes)
    console.print(f"peak RAM     {peak.host_bytes / MIB:.0f} MiB ({peak.stage}); GPU: a CUDA run's device memory")
