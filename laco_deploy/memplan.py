"""Memory planning: what a model's weights take in fp32, how much RAM is available, and the peak
host (RSS) and device memory each stage of a build is expected to need.

Sizes come from the model's config alone (a skeleton on `meta`, no weights read), per decoder
layer at its own width (structured-pruned models). The stage estimates add up what the code holds
at its peak: the process itself (Python, torch, transformers: `PROCESS_BYTES`), the weights a stage
keeps (the non-layer weights, one decoder layer or a pair, or a whole model where it is resident),
the activation caches and the largest temporaries. `benchmarks/scale_bench.py` checks them against
measured peaks from 135M to 1.1B parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from laco_deploy.config import PRUNABLE_LINEARS
from laco_deploy.memory import proc_bytes
from laco_deploy.models import decoder_layers, linear_modules

FP32 = 4  # bytes per weight: every stage computes in float32
MIB = 2**20
# A stage's process without the model: Python, torch, transformers, the tokenizer and calibration
# text, llama.cpp's library where it loads, report rendering. Measured as the peak RSS of each stage
# on a 7M-parameter model (benchmarks/scale_bench.py --sizes tiny) minus what the terms below add.
PROCESS_BYTES = {"prune": 460 * MIB, "compensate": 455 * MIB, "export": 575 * MIB, "fidelity": 655 * MIB}
LLAMA_CPP_BYTES = 40 * MIB  # llama.cpp's buffers besides the weights and the logits
Q8_0_BYTES = 34 / 32  # bytes per weight of a Q8_0 tensor (32 int8 + an fp16 scale)
KL_CHUNK_ROWS = 16  # fidelity.metrics computes log-softmax in float64 chunks of this many rows


def skeleton_of(path: Path):
    """The causal LM of the HF directory `path` on `meta` (reads config.json only)."""
    from transformers import AutoConfig

    from laco_deploy.engine.lazy import skeleton

    return skeleton(AutoConfig.from_pretrained(Path(path)))


def weight_bytes(model) -> dict[str, int]:
    """fp32 bytes of a (skeleton) model: all decoder layers, the largest one and its largest linear,
    embeddings, head (0 when tied), total; plus the shapes the estimates need."""
    layers = [sum(p.numel() for p in layer.parameters()) * FP32 for layer in decoder_layers(model)]
    linears = [lin.weight.numel() * FP32 for layer in decoder_layers(model)
               for lin in linear_modules(layer, PRUNABLE_LINEARS).values()]
    embed = model.model.embed_tokens.weight.numel() * FP32
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    head = 0 if tied else model.lm_head.weight.numel() * FP32
    total = sum(p.numel() for p in model.parameters()) * FP32  # tied weights counted once
    widths = [layer.mlp.down_proj.in_features for layer in decoder_layers(model)]
    return {"layers": sum(layers), "layer_max": max(layers, default=0), "linear_max": max(linears, default=0),
            "embed": embed, "head": head, "total": total, "num_layers": len(layers),
            "hidden": int(model.config.hidden_size), "vocab": int(model.config.vocab_size),
            "ffn_max": max(widths, default=0)}


def model_bytes(path: Path) -> dict[str, int]:
    """weight_bytes of the model in the HF directory `path`."""
    return weight_bytes(skeleton_of(path))


def available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where there is none, e.g. macOS)."""
    return proc_bytes("/proc/meminfo", "MemAvailable")


@dataclass(frozen=True)
class Workload:
    """The settings that size a build's memory; `of_build` reads them from a BuildConfig."""

    calib_samples: int  # prune
    seqlen: int  # prune samples and evaluation windows
    prune_batch: int
    prune_offload: str  # cpu: the model resident | disk: layers streamed
    compensate_samples: int  # LaCo, after the budget (compensate/budget.py)
    compensate_seqlen: int
    compensate_batch: int
    compensate_offload: str
    eval_windows: int  # all evaluation domains together
    torch_candidates: int  # fidelity: pruned (and recovered)
    runtime_candidates: int  # fidelity: the export
    parity_tokens: int = 128  # export: the llama.cpp vs PyTorch check (bench.parity.PARITY_TOKENS)

    @classmethod
    def of_build(cls, cfg, device) -> Workload:
        """The workload of `laco-deploy build` with BuildConfig `cfg` on `device`."""
        from laco_deploy.compensate.budget import resolve_budget
        from laco_deploy.data import eval_specs

        budget = resolve_budget(cfg.compensate, cfg.data, device)
        return cls(cfg.data.samples, cfg.data.seqlen, cfg.prune.batch_size, cfg.prune.offload, budget.samples,
                   budget.seqlen, cfg.compensate.batch_size, cfg.compensate.offload,
                   cfg.data.eval_samples * len(eval_specs(cfg.data.eval)),
                   1 + (cfg.compensate.method != "none"), 1)


@dataclass(frozen=True)
class StageEstimate:
    stage: str
    host_bytes: int  # peak RSS of the stage's process
    device_bytes: int  # peak CUDA memory when the stage runs on a GPU (the layer working set)
    terms: dict[str, int] = field(default_factory=dict)  # what the host estimate adds up


def _layer_batch(w: dict[str, int], tokens: int) -> int:
    """Activations inside one decoder layer's forward for `tokens` tokens (attention, MLP)."""
    return tokens * (8 * w["hidden"] + 3 * w["ffn_max"]) * FP32


def _stage(name: str, terms: dict[str, int], device: dict[str, int]) -> StageEstimate:
    return StageEstimate(name, sum(terms.values()), sum(device.values()), terms)


def estimate_prune(w: dict[str, int], job: Workload) -> StageEstimate:
    cache = job.calib_samples * job.seqlen * w["hidden"] * FP32
    weights = (w["embed"] + w["head"] + w["layer_max"]) if job.prune_offload == "disk" else w["total"]
    work = {"scores": 3 * w["linear_max"], "batch": _layer_batch(w, job.prune_batch * job.seqlen)}
    return _stage("prune", {"process": PROCESS_BYTES["prune"], "weights": weights, "activations": 2 * cache, **work},
                  {"layer": w["layer_max"], **work})


def estimate_compensate(w: dict[str, int], job: Workload) -> StageEstimate:
    cache = job.compensate_samples * job.compensate_seqlen * w["hidden"] * FP32
    resident = (w["embed"] + w["head"] + w["layer_max"]) if job.compensate_offload == "disk" else w["total"]
    # the layer being trained: its dense twin, grads + AdamW moments + the mask, autograd activations
    train = {"dense twin": w["layer_max"], "grads+adam+mask": 3 * w["layer_max"] + w["layer_max"] // 4,
             "batch": 2 * _layer_batch(w, job.compensate_batch * job.compensate_seqlen)}
    return _stage("compensate", {"process": PROCESS_BYTES["compensate"], "pruned model": resident,
                                 "activations": 4 * cache, **train}, {"layer": w["layer_max"], **train})


def estimate_export(w: dict[str, int], job: Workload) -> StageEstimate:
    """GGUF q8_0: the largest tensor read, reordered and quantized; then the parity check: PyTorch on
    the layer engine (embeddings or head, one layer, the logits), then llama.cpp with the file. On CPU."""
    tensor = max(w["linear_max"], w["embed"], w["head"])
    logits = job.parity_tokens * w["vocab"] * FP32
    write = 2 * tensor + tensor // 4
    torch_side = max(w["embed"], w["head"]) + w["layer_max"] + logits
    llama_side = gguf_bytes(w) + LLAMA_CPP_BYTES + 2 * logits
    return _stage("export", {"process": PROCESS_BYTES["export"], "writer or parity": max(write, torch_side, llama_side)}, {})


def estimate_fidelity(w: dict[str, int], job: Workload) -> StageEstimate:
    """Dense + PyTorch candidates walked side by side (one activation cache each, one layer, the
    head, one window's logits per model), then each runtime candidate alone next to the dense
    model's cache and head."""
    cache = job.eval_windows * job.seqlen * w["hidden"] * FP32
    head = w["head"] or w["embed"]
    logits = job.seqlen * w["vocab"] * FP32
    compare = 4 * KL_CHUNK_ROWS * w["vocab"] * 8  # float64 log-softmax chunks of both models
    torch_pass = (1 + job.torch_candidates) * cache + w["layer_max"] + 2 * head + 2 * logits + compare
    runtime = cache + head + gguf_bytes(w) + LLAMA_CPP_BYTES + 3 * logits + compare
    phase = max(torch_pass, runtime) if job.runtime_candidates else torch_pass
    return _stage("fidelity", {"process": PROCESS_BYTES["fidelity"], "models and activations": phase},
                  {"layer": w["layer_max"], "head": head, "batch": _layer_batch(w, 8 * job.seqlen)})


def gguf_bytes(w: dict[str, int]) -> int:
    """Size of the Q8_0 export (what llama.cpp maps)."""
    return int(w["total"] / FP32 * Q8_0_BYTES)


def estimate_build(w: dict[str, int], job: Workload) -> list[StageEstimate]:
    """Every stage that holds model weights, in build order (the benchmark stage runs each
    exported model in a child process of its own, about the export's llama.cpp share)."""
    return [estimate_prune(w, job), estimate_compensate(w, job), estimate_export(w, job), estimate_fidelity(w, job)]
