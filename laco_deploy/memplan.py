"""Memory planning: what a model's weights take in fp32, how much RAM is available, and the peak
host (RSS) and device memory each stage of a build is expected to need.

Sizes come from the model's config alone (a skeleton on `meta`, no weights read), per decoder
layer at its own width (structured-pruned models). Each stage is estimated phase by phase (what is
alive together: e.g. embedding the samples, the layer walk, saving) and its peak is the largest
phase: the process itself (Python, torch, transformers: `PROCESS_BYTES`), the weights the phase
holds (the embedding while the samples are embedded, one decoder layer or a pair, a block of the
LM head, a whole model where it is resident, the exported file where a runtime maps it), the
activation caches and the largest temporaries. `benchmarks/scale_bench.py` checks them against
measured peaks from 135M to 1.1B parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from laco_deploy.config import PRUNABLE_LINEARS, CompensateConfig
from laco_deploy.errors import ModelError
from laco_deploy.engine.forward import HEAD_BLOCK_BYTES
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
KL_CHUNK_TOKENS = 32  # the final KL pass makes its logits this many tokens at a time (compensate/klpass.py)


def skeleton_of(path: Path, trust_remote_code: bool = False):
    """The causal LM of the HF directory `path` on `meta` (reads config.json only)."""
    from transformers import AutoConfig

    from laco_deploy.engine.lazy import skeleton

    try:
        config = AutoConfig.from_pretrained(Path(path), trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:  # unreadable, or a model type only its own code defines
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelError(f"cannot read {Path(path) / 'config.json'}: {first}") from e
    return skeleton(config)


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
    dims = sum(sum(lin.weight.shape) + (lin.bias.numel() if lin.bias is not None else 0)
               for layer in decoder_layers(model) for lin in linear_modules(layer, PRUNABLE_LINEARS).values())
    return {"linear_dims": dims * FP32, "layers": sum(layers), "layer_max": max(layers, default=0), "linear_max": max(linears, default=0),
            "embed": embed, "head": head, "total": total, "num_layers": len(layers),
            "hidden": int(model.config.hidden_size), "vocab": int(model.config.vocab_size),
            "ffn_max": max(widths, default=0)}


def model_bytes(path: Path, trust_remote_code: bool = False) -> dict[str, int]:
    """weight_bytes of the model in the HF directory `path`."""
    return weight_bytes(skeleton_of(path, trust_remote_code))


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
    compensate_samples: int  # LaCo, after the budget (compensate/budget.py): the walk's
    compensate_seqlen: int
    compensate_batch: int
    compensate_offload: str
    eval_windows: int  # all evaluation domains together
    torch_candidates: int  # fidelity: pruned (and recovered)
    runtime_candidates: int  # fidelity: the export
    parity_tokens: int = 128  # export: the llama.cpp vs PyTorch check (bench.parity.PARITY_TOKENS)
    compensate_dense_twin: bool = False  # the LaCo step runs the dense twin (subblock loss, lsq init)
    compensate_final_kl: bool = False  # the whole-model KL pass after the walk (compensate/distill.py)
    compensate_final_kl_batch: int | None = None  # that pass's samples per step (None: compensate_batch)
    compensate_kl_samples: int = 0  # its samples (fresh ones, after the walk's)
    compensate_kl_optimizer: str = CompensateConfig.final_kl_optimizer

    @classmethod
    def of_build(cls, cfg, device, w: dict[str, int] | None = None) -> Workload:
        """The workload of `laco-deploy build` with BuildConfig `cfg` on `device`; `w` (weight_bytes
        of the model) lets a GPU's step size be checked against its free memory (compensate/steps.py)."""
        from laco_deploy import devices
        from laco_deploy.compensate import steps
        from laco_deploy.compensate.budget import resolve_budget
        from laco_deploy.compensate.laco import needs_dense_layer
        from laco_deploy.data import eval_specs

        budget = resolve_budget(cfg.compensate, cfg.data, device)
        step = steps.plan(cfg.compensate, budget.seqlen, budget.samples, w, devices.traits(device),
                          needs_dense_layer(cfg.compensate))
        return cls(cfg.data.samples, cfg.data.seqlen, cfg.prune.batch_size, cfg.prune.offload,
                   budget.samples, budget.seqlen, step.batch_size, cfg.compensate.offload,
                   cfg.data.eval_samples * len(eval_specs(cfg.data.eval)),
                   1 + (cfg.compensate.method != "none"), 1,
                   compensate_dense_twin=needs_dense_layer(cfg.compensate),
                   compensate_final_kl=budget.kl_samples > 0, compensate_final_kl_batch=step.final_kl_batch_size,
                   compensate_kl_samples=budget.kl_samples, compensate_kl_optimizer=cfg.compensate.final_kl_optimizer)


@dataclass(frozen=True)
class StageEstimate:
    stage: str
    host_bytes: int  # peak RSS of the stage's process
    device_bytes: int  # peak CUDA memory when the stage runs on a GPU (the layer working set)
    terms: dict[str, int] = field(default_factory=dict)  # what the host estimate adds up


def _layer_batch(w: dict[str, int], tokens: int) -> int:
    """Activations inside one decoder layer's forward for `tokens` tokens (attention, MLP)."""
    return tokens * (8 * w["hidden"] + 3 * w["ffn_max"]) * FP32


def _stage(name: str, phases: dict[str, dict[str, int]], device: dict[str, int]) -> StageEstimate:
    """A stage's estimate from its phases (what is alive together); the host peak is the largest
    phase, and `terms` are that phase's parts."""
    peak = max(phases.values(), key=lambda terms: sum(terms.values()))
    return StageEstimate(name, sum(peak.values()), sum(device.values()), peak)


def _largest_rest(w: dict[str, int]) -> int:
    """The largest non-layer tensor: the embedding or the untied head (read one at a time when a
    streamed model is saved: LazyModel.save copies them from the source file)."""
    return max(w["embed"], w["head"])


def estimate_prune(w: dict[str, int], job: Workload) -> StageEstimate:
    cache = job.calib_samples * job.seqlen * w["hidden"] * FP32
    work = {"scores": 3 * w["linear_max"], "batch": _layer_batch(w, job.prune_batch * job.seqlen)}
    process = {"process": PROCESS_BYTES["prune"]}
    if job.prune_offload != "disk":
        return _stage("prune", {"layers": {**process, "weights": w["total"], "activations": cache, **work}},
                      {"layer": w["layer_max"], **work})
    # streamed: the embedding only while the samples are embedded, one layer at a time, then the save
    return _stage("prune", {"embed": {**process, "embedding": w["embed"], "activations": cache},
                            "layers": {**process, "layer": w["layer_max"], "activations": cache, **work},
                            "save": {**process, "tensor": max(w["layer_max"], _largest_rest(w))}},
                  {"layer": w["layer_max"], **work})


def final_kl_terms(w: dict[str, int], tokens: int, optimizer: str) -> dict[str, int]:
    """What the final KL pass (compensate/distill.py, klpass.py) adds to the model it trains: the
    optimizer's state (Adafactor: out + in numbers per matrix; AdamW: two moments per weight), the
    masks as bits, every layer's input for one batch of `tokens`, one layer's training (its
    gradients, autocast's half-precision copies, the recomputed activations) and the logits of one
    chunk of tokens with their softmax and gradient (~12 fp32 copies)."""
    state = 2 * w["layers"] if optimizer == "adamw" else w["linear_dims"]
    return {"optimizer": state, "masks": w["layers"] // (8 * FP32),
            "layer inputs": w["num_layers"] * tokens * w["hidden"] * FP32,
            "layer training": w["layer_max"] + w["layer_max"] // 2 + 2 * _layer_batch(w, tokens),
            "logits": 12 * KL_CHUNK_TOKENS * w["vocab"] * FP32}


def final_kl_device_bytes(w: dict[str, int], tokens: int, optimizer: str) -> int:
    """Device bytes of the final KL pass's step: one layer, the final norm and head, and its terms."""
    return w["layer_max"] + _largest_rest(w) + sum(final_kl_terms(w, tokens, optimizer).values())


def whole_model_terms(w: dict[str, int], tokens: int) -> dict[str, int]:
    """What training the whole resident model in one autograd graph adds to its weights (the LoRA
    baseline's step, sized like the former whole-model KL pass: 3304 MiB measured for it on the
    default build): AdamW-sized state, the largest layer's gradients, a byte per weight, autocast's
    half-precision copies of every weight, ~12 fp32 copies of the logits and every layer's activations."""
    return {"adam": 2 * w["layers"], "grads": w["layer_max"], "masks": w["layers"] // FP32,
            "autocast copies": (w["layers"] + _largest_rest(w)) // 2,
            "logits": 12 * tokens * w["vocab"] * FP32, "batch": w["num_layers"] * _layer_batch(w, tokens)}


def _final_kl_phases(w: dict[str, int], job: Workload, process: dict[str, int]) -> dict[str, dict[str, int]]:
    """The pass's phases: the dense twin walked alone over its samples (two caches, one layer), then
    the pass (its samples' embeddings and the teacher). A streamed model holds one layer and the head."""
    kl_cache = job.compensate_kl_samples * job.compensate_seqlen * w["hidden"] * FP32
    model = ({"pruned model": w["total"]} if job.compensate_offload != "disk" else
             {"layer": w["layer_max"], "norm + head": _largest_rest(w)})
    tokens = (job.compensate_final_kl_batch or job.compensate_batch) * job.compensate_seqlen
    teacher = {**process, **model, "dense layer": w["layer_max"], "activations": kl_cache,
               "batch": _layer_batch(w, job.compensate_batch * job.compensate_seqlen)}
    train = {**process, **model, "pass caches": 2 * kl_cache,
             **final_kl_terms(w, tokens, job.compensate_kl_optimizer)}
    return {"final KL teacher": teacher, "final KL": train}


def layer_step_terms(w: dict[str, int], tokens: int, dense_twin: bool) -> dict[str, int]:
    """The LaCo step on the device besides the layer itself: grads + AdamW moments + the mask,
    autograd activations of `tokens` tokens, and the dense twin where the step runs it (else the
    streamed twin leaves once its outputs are computed)."""
    return {"dense twin": w["layer_max"] if dense_twin else 0,
            "grads+adam+mask": 3 * w["layer_max"] + w["layer_max"] // 4,
            "adam step": 2 * w["linear_max"],  # AdamW's per-tensor temporaries (sqrt, then the denominator)
            "batch": 2 * _layer_batch(w, tokens)}


def activation_cache_bytes(w: dict[str, int], samples: int, seqlen: int) -> int:
    """One activation cache of the walk: [samples, seqlen, hidden] fp32 (the walk keeps two or three)."""
    return samples * seqlen * w["hidden"] * FP32


def estimate_compensate(w: dict[str, int], job: Workload) -> StageEstimate:
    cache = activation_cache_bytes(w, job.compensate_samples, job.compensate_seqlen)
    train = layer_step_terms(w, job.compensate_batch * job.compensate_seqlen, job.compensate_dense_twin)
    process = {"process": PROCESS_BYTES["compensate"]}
    device = {"layer": w["layer_max"], **train}
    # each layer's outputs overwrite its inputs (engine.walk): one sparse cache, one dense cache, and
    # the dense inputs besides where the step reads them
    activations = (3 if job.compensate_dense_twin else 2) * cache
    final = _final_kl_phases(w, job, process) if job.compensate_final_kl else {}
    if job.compensate_offload != "disk":
        return _stage("compensate", {"layers": {**process, "pruned model": w["total"], "activations": activations, **train},
                                     **final}, device)
    return _stage("compensate", {"embed": {**process, "embedding": w["embed"], "activations": cache},
                                 "layers": {**process, "layer": w["layer_max"], "activations": activations, **train},
                                 "save": {**process, "tensor": max(w["layer_max"], _largest_rest(w))}, **final}, device)


def estimate_export(w: dict[str, int], job: Workload) -> StageEstimate:
    """GGUF q8_0: the largest tensor read and quantized (the source tensor and its packed copy); then
    the parity check: PyTorch on the layer engine (the embedding, then one layer, the final norm
    and a block of the head, the logits), then llama.cpp with the whole file mapped. On CPU."""
    tensor = max(w["linear_max"], w["embed"], w["head"])
    logits = job.parity_tokens * w["vocab"] * FP32
    process = {"process": PROCESS_BYTES["export"]}
    return _stage("export", {
        "write": {**process, "tensor + packed": tensor + int(tensor / FP32 * Q8_0_BYTES)},
        "torch parity": {**process, "embedding or layer": max(w["embed"], w["layer_max"] + HEAD_BLOCK_BYTES), "logits": logits},
        "llama.cpp parity": {**process, "gguf file": gguf_bytes(w), "llama.cpp": LLAMA_CPP_BYTES, "logits": 2 * logits}}, {})


def estimate_fidelity(w: dict[str, int], job: Workload) -> StageEstimate:
    """Every model embeds the windows (its embedding matrix read, used, dropped), then dense + PyTorch
    candidates are walked side by side (one activation cache each, one layer), their logits made one
    window at a time with the head read in blocks of vocabulary rows; then each runtime candidate
    alone, next to the dense model's cache."""
    cache = job.eval_windows * job.seqlen * w["hidden"] * FP32
    caches = (1 + job.torch_candidates) * cache
    logits = job.seqlen * w["vocab"] * FP32
    compare = 4 * KL_CHUNK_ROWS * w["vocab"] * 8  # float64 log-softmax chunks of both models
    process = {"process": PROCESS_BYTES["fidelity"]}
    phases = {"embed": {**process, "embedding": w["embed"], "caches": caches},
              "layers": {**process, "caches": caches, "layer": w["layer_max"]},
              "logits": {**process, "caches": caches, "head block": HEAD_BLOCK_BYTES, "logits": 2 * logits,
                         "compare": compare}}
    if job.runtime_candidates:
        phases["runtime"] = {**process, "cache": cache, "head block": HEAD_BLOCK_BYTES, "gguf file": gguf_bytes(w),
                             "llama.cpp": LLAMA_CPP_BYTES, "logits": 3 * logits, "compare": compare}
    return _stage("fidelity", phases, {"layer": w["layer_max"], "head block": HEAD_BLOCK_BYTES,
                                       "batch": _layer_batch(w, 8 * job.seqlen)})


def gguf_bytes(w: dict[str, int]) -> int:
    """Size of the Q8_0 export (what llama.cpp maps)."""
    return int(w["total"] / FP32 * Q8_0_BYTES)


def estimate_build(w: dict[str, int], job: Workload) -> list[StageEstimate]:
    """Every stage that holds model weights, in build order (the benchmark stage runs each
    exported model in a child process of its own, about the export's llama.cpp share)."""
    return [estimate_prune(w, job), estimate_compensate(w, job), estimate_export(w, job), estimate_fidelity(w, job)]
