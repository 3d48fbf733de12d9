"""What a compensation run writes about itself: config.json summary, sparsity.json, the result record."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from laco_deploy.artifacts import ModelDirResult, pattern_label
from laco_deploy.config import CompensateConfig, to_dict
from laco_deploy.throughput import throughput_record

MIB = 2**20
NOT_COUNTED = "not counted"  # a FLOP count the counter could not make (laco_deploy/flops.py)


def config_summary(info: dict[str, Any], cfg: CompensateConfig, budget, sparsity: float) -> dict[str, Any]:
    """The pruned model's `laco_deploy` dict, moved to stage "compensate" with this run's settings."""
    out = dict(info)
    out.update({"stage": "compensate", "prune_method": info.get("method"), "method": cfg.method,
                "samples": budget.samples, "seqlen": budget.seqlen, "epochs": cfg.epochs, "sparsity": sparsity})
    if cfg.method == "laco":
        out.update({"loss": cfg.loss, "lr": cfg.lr, "train_norms": cfg.train_norms, "trainable": cfg.trainable})
        if cfg.trainable == "lowrank":
            out["correction_rank"] = cfg.correction_rank
        if cfg.quant_aware is not None:  # the grid the weights were trained through (imatrix.TRAINED_FILE: its weighting)
            out["quant_aware"] = cfg.quant_aware
            out["quant_imatrix"] = cfg.quant_imatrix
    else:
        out.update({"loss": "lm", "lora_rank": cfg.lora_rank, "lora_lr": cfg.lora_lr, "merge": "under mask"})
    return out


def sparsity_document(pruned_doc: Path, before: dict, after: dict, cfg: CompensateConfig) -> dict[str, Any]:
    """The pruned `sparsity.json` (kept as is) plus a `compensate` section re-measured after training."""
    doc = json.loads(pruned_doc.read_text()) if pruned_doc.is_file() else {}
    changed = [k for k, m in after["matrices"].items() if m["zeros"] != before["matrices"].get(k, {}).get("zeros")]
    doc["compensate"] = {
        "method": cfg.method,
        "sparsity_before": before["sparsity"], "sparsity_after": after["sparsity"],
        "zeros_before": before["zeros"], "zeros_after": after["zeros"], "elements": after["elements"],
        "matrices_with_changed_zero_count": changed,
    }
    return doc


def _max_working_set(records: list[dict]) -> dict[str, int]:
    sets = [r.get("device_working_set") or {} for r in records]
    return max(sets, key=lambda s: s.get("total", 0), default={})


def memory_summary(records: list[dict], lora_record: dict | None, meter, device) -> dict[str, Any]:
    ws = (lora_record or {}).get("device_working_set") or _max_working_set(records)
    return {
        "memory_kind": "cuda_max_allocated" if device.type == "cuda" else "rss",
        "peak_mib": round(meter.peak_bytes / MIB, 1),
        "peak_delta_mib": round(meter.peak_delta_bytes / MIB, 1),
        "device_working_set_mib": {k: round(v / MIB, 2) for k, v in ws.items()},
    }


def training_throughput(records: list[dict], lora_record: dict | None, reference_gflops: float) -> dict | None:
    """Achieved GFLOP/s of the training steps (LaCo: summed over layers) against the run's matmul;
    {"gflop": "not counted"} when the FLOP counter failed on any of them (laco_deploy/flops.py)."""
    rows = [lora_record] if lora_record else records
    if any(isinstance(r.get("train_gflop"), str) for r in rows):
        return {"gflop": NOT_COUNTED, "matmul_gflops": round(reference_gflops, 2)}
    gflop = sum(r.get("train_gflop", 0.0) for r in rows)
    seconds = sum(r.get("step_s", r.get("train_s", 0.0)) for r in rows)  # the steps alone where timed
    return throughput_record(gflop, seconds, reference_gflops) if gflop > 0 else None


def _lr_notes(records: list[dict]) -> list[str]:
    """Layers that trained at a smaller lr than their first (train.LayerTrainer.fit), and layers no epoch improved."""
    notes = []
    retried = [r["layer"] for r in records if len(r.get("lr_tried", ())) > 1]
    if retried:
        first = next(r["lr_tried"][0] for r in records if len(r.get("lr_tried", ())) > 1)
        notes.append(f"{len(retried)} of {len(records)} layers rose in their first epoch at lr {first:g} and started over "
                     f"at a smaller one (layers {', '.join(map(str, retried))})")
    kept = [r["layer"] for r in records if r.get("best_epoch") == 0]
    if kept:
        notes.append(f"no training epoch beat the starting held-out loss in {len(kept)} of {len(records)} layers (layers "
                     f"{', '.join(map(str, kept))}): they kept their starting weights")
    return notes


def result_record(out_dir: Path, info: dict, cfg: CompensateConfig, budget, before: dict, after: dict,
                  records: list[dict], lora_record: dict | None, meter, wall: float, device,
                  reference_gflops: float = 0.0, data: dict | None = None,
                  final_kl: dict | None = None, steps_note: str = "", model_guard: dict | None = None) -> ModelDirResult:
    mem = memory_summary(records, lora_record, meter, device)
    speed = training_throughput(records, lora_record, reference_gflops)
    notes = [budget.note] + ([steps_note] if steps_note else [])
    same = after["zeros"] >= before["zeros"] and not [k for k in after["matrices"]
                                                     if after["matrices"][k]["zeros"] < before["matrices"][k]["zeros"]]
    notes.append(f"sparsity {before['sparsity']:.6f} before, {after['sparsity']:.6f} after"
                 + (" (every zero kept)" if same else " (ZEROS LOST: report this as a bug)"))
    ws = mem["device_working_set_mib"].get("total")
    notes.append(f"peak memory {mem['peak_mib']} MiB ({mem['memory_kind']}), +{mem['peak_delta_mib']} MiB over the footprint "
                 f"at entry; device working set {ws} MiB (params + grads + AdamW state + saved activations + batch)")
    if records:
        nb = sum(r["nmse_before"] for r in records) / len(records)
        na = sum(r["nmse_after"] for r in records) / len(records)
        notes.append(f"mean layer nmse {nb:.4g} -> {na:.4g} ({records[0]['measured_on']} samples)")
        notes.extend(_lr_notes(records))
    if speed is not None and speed["gflop"] == NOT_COUNTED:
        notes.append("training throughput not counted: the FLOP counter failed (the debug log says why)")
    elif speed is not None:
        notes.append(f"training throughput {speed['achieved_gflops']:.1f} GFLOP/s ({speed['gflop']:.0f} GFLOP in "
                     f"{speed['seconds']:.0f} s of training steps), {speed['share_of_matmul']:.0%} of a {cfg.precision} matmul "
                     f"measured in this run ({speed['matmul_gflops']:.0f} GFLOP/s)")
    if final_kl:
        notes.append(f"final KL pass: {final_kl['steps']} steps over the whole model, held-out KL to the dense logits "
                     f"{final_kl['kl_before']:.4g} -> {final_kl['kl_after']:.4g} ({final_kl['train_s']:.0f} s, peak "
                     f"{final_kl.get('peak_mib', 0):.0f} MiB, +{final_kl.get('peak_delta_mib', 0):.0f} MiB while it ran)"
                     + ("" if final_kl.get("kept", True) else "; the held-out KL rose, so the walk's weights were kept"))
    if model_guard:
        notes.append(f"held-out KL to the dense logits: pruned {model_guard['kl_pruned']:.4g}, recovered "
                     f"{model_guard['kl_recovered']:.4g} on {model_guard['samples']} samples"
                     + ("" if model_guard["kept"] else "; the recovery made the model WORSE, so the pruned weights were kept"))
    if lora_record:
        m = lora_record["merge"]
        notes.append(f"LoRA merged under the mask; an unmasked merge would have filled {m['share_of_zeros_lost_unmasked']:.1%} "
                     f"of the zeros (sparsity {m['unmasked_merge_sparsity']:.4f} instead of {after['sparsity']:.4f})")
    settings = {"compensate": to_dict(cfg), "budget": {"samples": budget.samples, "seqlen": budget.seqlen,
                "epochs": budget.epochs, "source": budget.source}, "memory": mem,
                "sparsity_before": before["sparsity"], "device": str(device), "throughput": speed}
    if data is not None:  # which text calibrated the model (builtin, builtin:mixed, a file)
        settings["data"] = data
    if lora_record:
        settings["lora"] = lora_record
    if final_kl:
        settings["final_kl"] = final_kl
    if model_guard:
        settings["model_guard"] = model_guard
    return ModelDirResult(model_dir=str(out_dir), stage="compensate", sparsity=after["sparsity"], pattern=pattern_label(info.get("pattern"), info.get("target_sparsity", info.get("sparsity"))),
                          settings=settings, per_layer=records, wall_s=round(wall, 3), peak_mib=mem["peak_mib"],
                          memory_kind=mem["memory_kind"], notes=notes)
