"""`laco-deploy compensate`: repair a pruned model with LaCo layer-wise compensation (or the LoRA baseline)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from laco_deploy.cli.app import app
from laco_deploy.cli.common import (
    CalibOpt,
    DeviceOpt,
    OffloadOpt,
    TrustRemoteCodeOpt,
    ResumeOpt,
    SeedOpt,
    SeqlenOpt,
    ForceOpt,
    check_model_out,
    console,
    model_config,
    section_from_flags,
)
from laco_deploy.config import IMATRIX_CALIB, LOSSES, CompensateConfig, DataConfig, ModelConfig
from laco_deploy.fsutil import check_output

_C, _D = CompensateConfig(), DataConfig()


def _summary(result) -> None:
    from rich.table import Table

    s = result.settings
    console.print(f"compensated ({s['compensate']['method']}) {result.pattern} model written to {result.model_dir}")
    if result.per_layer:
        table = Table("layer", "nmse before", "nmse after", "epochs", "time s", "peak MiB", title="per layer")
        for r in result.per_layer:
            table.add_row(str(r["layer"]), f"{r['nmse_before']:.4g}", f"{r['nmse_after']:.4g}", str(r["epochs_run"]),
                          f"{r['time_s']:.1f}", f"{r['peak_mib']:.0f}")
        console.print(table)
    if "lora" in s:
        lo = s["lora"]
        console.print(f"LM loss (held-out) {lo['lm_loss_before']} -> {lo['lm_loss_after']} after {lo['epochs_run']} epochs")
    console.print(f"wall time {result.wall_s:.1f} s" + (f" on {s['device']}" if "device" in s else ""))  # method none: a copy
    for note in result.notes:
        console.print(f"  {note}")


@app.command("compensate")
def compensate_command(
    dense: Annotated[str, typer.Option("--dense", help="The dense model that was pruned: a HF directory, a .gguf file, a hub id or 'default'.")] = ModelConfig.model,
    sparse: Annotated[Path, typer.Option("--sparse", help="Pruned model directory written by `laco-deploy prune`.")] = ...,
    out: Annotated[Path, typer.Option("--out", "-o", help="Output directory for the compensated model (written atomically; checkpoints in OUT.ckpt).")] = ...,
    method: Annotated[str, typer.Option("--method", help="laco (layer-wise), lora (PEFT LoRA baseline, whole model) or none (copy).")] = _C.method,
    loss: Annotated[Optional[str], typer.Option("--loss", help=f"LaCo loss, one of {', '.join(LOSSES)}: nmse is per-token normalized, channel_nmse per hidden channel (for residual streams with a few huge channels), subblock fits attention and MLP outputs separately. Default: the model family's (channel_nmse for Gemma 2/3, nmse for the others).")] = _C.loss,
    epochs: Annotated[int, typer.Option("--epochs", help="Passes over the calibration samples per layer (LoRA: over the model).")] = _C.epochs,
    lr: Annotated[Optional[float], typer.Option("--lr", help="LaCo AdamW learning rate (cosine schedule). Default: the model family's (3e-4 for Gemma 2/3, whose linears are ~5x smaller; 3e-3 for the others).")] = _C.lr,
    lr_last_factor: Annotated[float, typer.Option("--lr-last-factor", help="LaCo: the last layer's LR is lr * this (geometric decay over depth).")] = _C.lr_last_factor,
    batch_size: Annotated[Optional[int], typer.Option("--batch-size", help=(
        f"Samples per training step (memory grows with it). Default: by device: {_C.cpu_batch_size} on a CPU; on a GPU "
        f"about {_C.gpu_tokens_per_step} tokens per step within {_C.memory_share:.0%} of its free memory, with the "
        "learning rates scaled by sqrt(batch / 2)."))] = _C.batch_size,
    device_caches: Annotated[bool, typer.Option("--device-caches/--no-device-caches", help="On a GPU, keep LaCo's activation caches on it when they fit (faster); off: in RAM, the least GPU memory.")] = _C.device_caches,
    grad_accum: Annotated[int, typer.Option("--grad-accum", help="Steps of gradient accumulation per update.")] = _C.grad_accum,
    train_norms: Annotated[bool, typer.Option("--train-norms/--no-train-norms", help="LaCo: also train the RMSNorm scales.")] = _C.train_norms,
    trainable: Annotated[str, typer.Option("--trainable", help="LaCo: what is trained. weights: the surviving weights (best measured); channel: one scale per output channel; lowrank: a rank --correction-rank update under the mask. The corrections are merged back, so the model has no extra modules; they need less gradient and optimizer memory.")] = _C.trainable,
    correction_rank: Annotated[int, typer.Option("--correction-rank", help="Rank of the lowrank correction.")] = _C.correction_rank,
    anchor_decay: Annotated[float, typer.Option("--anchor-decay", help="LaCo: after each step pull the weights back towards the pruned ones by lr * this * (w - w_pruned); limits drift from what pruning left, a regularizer for text unlike the calibration data (0: off).")] = _C.anchor_decay,
    dense_input_mix: Annotated[float, typer.Option("--dense-input-mix", help="LaCo: share of training samples fed the dense model's input to the layer instead of the compensated sparse path's (both have the same dense target); more varied inputs per layer (0: off).")] = _C.dense_input_mix,
    quant_aware: Annotated[Optional[str], typer.Option("--quant-aware", help="LaCo: train through the weights as this export type will store them (fake quantization with a straight-through gradient), so LaCo repairs the quantization error too: q8_0, q6_k, q5_k_m, q5_k_s, q4_k_m, q4_k_s, q3_k_m, q3_k_s, q2_k (GGUF, llama.cpp's per-tensor types), q4_k (Q4_K blocks everywhere) or int8 (ONNX). Default: off.")] = None,
    quant_imatrix: Annotated[Optional[str], typer.Option("--quant-imatrix", help=f"With --quant-aware (a GGUF type): train through llama.cpp's importance-weighted quantizer, the one `export --imatrix` runs, starting from its grid. '{IMATRIX_CALIB}': the pruned model's importance matrix on the walk's calibration samples (as llama-imatrix computes it); or an importance-matrix file (`laco-deploy imatrix`, llama-imatrix). Kept in --out as imatrix.gguf, which `export --imatrix` then uses, so the export reproduces the grid trained through. Default: the unweighted quantizer (export without --imatrix).")] = None,
    precision: Annotated[str, typer.Option("--precision", help="Compute precision of training (and of LaCo's layer calls): auto = bf16 autocast on CUDA (fp16 where bf16 is unsupported) and on CPUs with native bf16 matmul (AMX, AVX512-BF16), fp32 elsewhere; or fp32, bf16, fp16. Weights, optimizer state and activations stay fp32.")] = _C.precision,
    final_kl_epochs: Annotated[int, typer.Option("--final-kl-epochs", help="LaCo: after the layer walk, passes of the whole model over fresh calibration samples (--final-kl-samples) with KL to the dense model's logits (the teacher: the dense twin's last hidden states, its layers streamed one at a time); the model runs one layer at a time, so the pass needs about one layer's training state more than the walk, also streamed from disk (--offload disk); on CPU it costs about the walk's time again per pass; skipped, with a message, only when the memory is short (0: off).")] = _C.final_kl_epochs,
    final_kl_lr: Annotated[Optional[float], typer.Option("--final-kl-lr", help="LaCo: learning rate of the final KL pass (cosine schedule). Default: the optimizer's measured best on the default model, Adafactor 1e-3 (relative to each weight's RMS; 2e-3 raised the held-out KL there) or AdamW 3e-4 (absolute).")] = None,
    final_kl_optimizer: Annotated[str, typer.Option("--final-kl-optimizer", help="LaCo: optimizer of the final KL pass: adafactor (factored moments, out + in numbers per matrix: the pass needs about one layer's training state more than the walk; measured on the default build: 742 MiB less than adamw, gap closed within 0.3-2.2 points of it per domain) or adamw (two moments per weight, 8 bytes each: 0.85 GB on the default model, 56 GB on a 7B one).")] = _C.final_kl_optimizer,
    final_kl_samples: Annotated[Optional[int], typer.Option("--final-kl-samples", help="LaCo: calibration samples of the final KL pass, drawn after the walk's and never trained on by it (the walk fits its own samples far more closely than other text). Default: as many as the walk's.")] = None,
    val_fraction: Annotated[float, typer.Option("--val-fraction", help="Held-out share of calibration samples for early stopping (0: none).")] = _C.val_fraction,
    patience: Annotated[int, typer.Option("--patience", help="Epochs without held-out improvement before stopping.")] = _C.patience,
    lora_rank: Annotated[int, typer.Option("--lora-rank", help="LoRA rank.")] = _C.lora_rank,
    lora_lr: Annotated[float, typer.Option("--lora-lr", help="LoRA AdamW learning rate.")] = _C.lora_lr,
    offload: OffloadOpt = _C.offload,
    resume: ResumeOpt = False,
    force: ForceOpt = False,
    device: DeviceOpt = ModelConfig.device,
    trust_remote_code: TrustRemoteCodeOpt = False,
    calib: CalibOpt = _D.calib,
    samples: Annotated[Optional[int], typer.Option("--samples", help=f"Calibration samples. Default: {_C.gpu_samples} on CUDA (the paper), {_C.cpu_samples} on CPU (a small budget, at most {_C.cpu_seqlen} tokens each).")] = None,
    seqlen: SeqlenOpt = _D.seqlen,
    seed: SeedOpt = _D.seed,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Also write the result record as JSON here. Default: not written.")] = None,
) -> None:
    """Compensate a pruned model layer by layer so each layer reproduces the dense model's hidden states.

    Only one decoder layer and its dense twin are on the device at a time; activations stay in RAM
    or on disk. The sparsity pattern is kept bit-exactly.
    """
    flags = dict(locals())  # first: the flags only
    _run(model_config(dense, device, False, trust_remote_code),
         DataConfig(calib=calib, samples=samples if samples is not None else _D.samples, seqlen=seqlen, seed=seed),
         section_from_flags(CompensateConfig, flags), sparse, out, resume=resume, force=force, json_out=json_out)


def _run(mcfg: ModelConfig, dcfg: DataConfig, ccfg: CompensateConfig, sparse: Path, out: Path, *, resume: bool,
         force: bool, json_out: Path | None) -> None:
    check_model_out(out, force)
    from laco_deploy.artifacts import ModelDirResult

    check_output(json_out, "--json", force=force, kind="file", made_here=ModelDirResult.written_at, force_option="--force")
    from laco_deploy.compensate import run

    result = run(mcfg, dcfg, ccfg, sparse, out, resume=resume)  # through the stage's boundary
    _summary(result)
    if json_out is not None:
        from laco_deploy.fsutil import write_json

        write_json(json_out, result.to_dict())
        console.print(f"wrote {json_out}")
