"""The build's memory estimator (`laco-deploy plan`): the peak host (RSS) and device memory each
stage of a build is expected to need. Above the stages: it reads their settings and policies
(compensate/budget.py, compensate/steps.py); the sizes it adds up come from sizing.py.

Each stage is estimated phase by phase (what is
alive together: e.g. embedding the samples, the layer walk, saving) and its peak is the largest
phase: the process itself (Python, torch, transformers: `PROCESS_BYTES`), the weights the phase
holds (the embedding while the samples are embedded, one decoder layer or a pair, a block of the
LM head, a whole model where it is resident, the exported file where a runtime maps it), the
activation caches and the largest temporaries. `benchmarks/scale_bench.py` checks them against
measured peaks from 135M to 1.1B parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from laco_deploy.config import CompensateConfig
from laco_deploy.divergence import ROW_CHUNK
from laco_deploy.engine.forward import HEAD_BLOCK_BYTES
from laco_deploy.runtimes.llamacpp import LOGIT_BLOCK_BYTES
from laco_deploy.sizing import (FP32, MIB, activation_cache_bytes, embedding_rows_bytes, final_kl_terms, largest_rest,
                                layer_batch_bytes, layer_step_terms, zeroshot_logit_bytes)

# A stage's process without the model: Python, torch, transformers, the tokenizer and calibration
# text, llama.cpp's library where it loads, report rendering. Measured as the peak RSS of each stage
# on a 7M-parameter model (benchmarks/scale_bench.py --sizes tiny) minus what the terms below add,
# with SmolLM2's tokenizer (PROCESS_VOCAB tokens; scale_bench's models all use it).
PROCESS_BYTES = {"prune": 460 * MIB, "compensate": 455 * MIB, "export": 575 * MIB, "fidelity": 655 * MIB}
PROCESS_VOCAB = 49152
# Another vocabulary moves every stage's process by what its tokenizer holds: loaded after the stack's
# imports (tokenizer.load_tokenizer), SmolLM2's took +92 MiB, Gemma 3's 262,144 tokens +132 MiB
# (+276 before the Python copies were dropped; benchmarks/RESULTS.md, "Gemma 3's zero-shot phase"):
# the slope between the two, per token.
PROCESS_BYTES_PER_TOKEN = 197
LLAMA_CPP_BYTES = 40 * MIB  # llama.cpp's buffers besides the weights and the logits
Q8_0_BYTES = 34 / 32  # bytes per weight of a Q8_0 tensor (32 int8 + an fp16 scale)


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
    parity_tokens: int = 128  # export: the llama.cpp vs PyTorch check (runtimes.parity.PARITY_TOKENS)
    compensate_dense_twin: bool = False  # the LaCo step runs the dense twin (subblock loss, lsq init)
    compensate_final_kl: bool = False  # the whole-model KL pass after the walk (compensate/distill.py)
    compensate_final_kl_batch: int | None = None  # that pass's samples per step (None: compensate_batch)
    compensate_kl_samples: int = 0  # its samples (fresh ones, after the walk's)
    compensate_kl_optimizer: str = CompensateConfig.final_kl_optimizer
    zeroshot: bool = False  # fidelity runs zero-shot tasks
    zeroshot_batch: int | None = None  # their sequences per harness call (None: sizing.zeroshot_batch's choice)

    @classmethod
    def of_build(cls, cfg, device, w: dict[str, int] | None = None) -> Workload:
        """The workload of `laco-deploy build` with BuildConfig `cfg` on `device`; `w` (weight_bytes
        of the model) lets a GPU's step size be checked against its free memory (compensate/steps.py)."""
        from laco_deploy import devices
        from laco_deploy.compensate import steps
        from laco_deploy.compensate.budget import resolve_budget
        from laco_deploy.data import eval_specs

        budget = resolve_budget(cfg.compensate, cfg.data, device)
        step = steps.plan(cfg.compensate, budget.seqlen, budget.samples, w, devices.traits(device),
                          cfg.compensate.needs_dense_layer)
        return cls(cfg.data.samples, cfg.data.seqlen, cfg.prune.batch_size, cfg.prune.offload,
                   budget.samples, budget.seqlen, step.batch_size, cfg.compensate.offload,
                   cfg.data.eval_samples * len(eval_specs(cfg.data.eval)),
                   1 + cfg.compensate.recovers, 1,
                   compensate_dense_twin=cfg.compensate.needs_dense_layer,
                   compensate_final_kl=budget.kl_samples > 0, compensate_final_kl_batch=step.final_kl_batch_size,
                   compensate_kl_samples=budget.kl_samples, compensate_kl_optimizer=cfg.compensate.final_kl_optimizer,
                   zeroshot=bool(cfg.fidelity.tasks), zeroshot_batch=cfg.fidelity.task_batch_size)


@dataclass(frozen=True)
class StageEstimate:
    stage: str
    host_bytes: int  # peak RSS of the stage's process
    device_bytes: int  # peak CUDA memory when the stage runs on a GPU (the layer working set)
    terms: dict[str, int] = field(default_factory=dict)  # what the host estimate adds up


def _process(stage: str, w: dict[str, int]) -> dict[str, int]:
    """The stage's process without the model, at this model's vocabulary."""
    return {"process": PROCESS_BYTES[stage] + PROCESS_BYTES_PER_TOKEN * (w["vocab"] - PROCESS_VOCAB)}


def _stage(name: str, phases: dict[str, dict[str, int]], device: dict[str, int]) -> StageEstimate:
    """A stage's estimate from its phases (what is alive together); the host peak is the largest
    phase, and `terms` are that phase's parts."""
    peak = max(phases.values(), key=lambda terms: sum(terms.values()))
    return StageEstimate(name, sum(peak.values()), sum(device.values()), peak)


def estimate_prune(w: dict[str, int], job: Workload) -> StageEstimate:
    cache = job.calib_samples * job.seqlen * w["hidden"] * FP32
    work = {"scores": 3 * w["linear_max"], "batch": layer_batch_bytes(w, job.prune_batch * job.seqlen)}
    process = _process("prune", w)
    if job.prune_offload != "disk":
        return _stage("prune", {"layers": {**process, "weights": w["total"], "activations": cache, **work}},
                      {"layer": w["layer_max"], **work})
    # streamed: the embedding only while the samples are embedded, one layer at a time, then the save
    return _stage("prune", {"embed": {**process, "embedding rows": embedding_rows_bytes(w, job.calib_samples * job.seqlen),
                                      "activations": cache},
                            "layers": {**process, "layer": w["layer_max"], "activations": cache, **work},
                            "save": {**process, "tensor": max(w["layer_max"], largest_rest(w))}},
                  {"layer": w["layer_max"], **work})


def _final_kl_phases(w: dict[str, int], job: Workload, process: dict[str, int]) -> dict[str, dict[str, int]]:
    """The pass's phases: the dense twin walked alone over its samples (two caches, one layer), then
    the pass (the teacher, and a streamed model's samples' embeddings: a resident one embeds each batch
    when asked). A streamed model holds one layer and the head."""
    kl_cache = job.compensate_kl_samples * job.compensate_seqlen * w["hidden"] * FP32
    model = ({"pruned model": w["total"]} if job.compensate_offload != "disk" else
             {"layer": w["layer_max"], "norm + head": largest_rest(w)})
    tokens = (job.compensate_final_kl_batch or job.compensate_batch) * job.compensate_seqlen
    teacher = {**process, **model, "dense layer": w["layer_max"], "activations": kl_cache,
               "batch": layer_batch_bytes(w, job.compensate_batch * job.compensate_seqlen)}
    streamed = job.compensate_offload == "disk"
    train = {**process, **model, "pass caches": (2 if streamed else 1) * kl_cache,
             **final_kl_terms(w, tokens, job.compensate_kl_optimizer, on_disk=streamed)}
    return {"final KL teacher": teacher, "final KL": train}


def estimate_compensate(w: dict[str, int], job: Workload) -> StageEstimate:
    cache = activation_cache_bytes(w, job.compensate_samples, job.compensate_seqlen)
    train = layer_step_terms(w, job.compensate_batch * job.compensate_seqlen, job.compensate_dense_twin)
    process = _process("compensate", w)
    device = {"layer": w["layer_max"], **train}
    # each layer's outputs overwrite its inputs (engine.walk): one sparse cache, one dense cache, and
    # the dense inputs besides where the step reads them
    activations = (3 if job.compensate_dense_twin else 2) * cache
    final = _final_kl_phases(w, job, process) if job.compensate_final_kl else {}
    if job.compensate_offload != "disk":
        return _stage("compensate", {"layers": {**process, "pruned model": w["total"], "activations": activations, **train},
                                     **final}, device)
    rows = embedding_rows_bytes(w, job.compensate_samples * job.compensate_seqlen)
    return _stage("compensate", {"embed": {**process, "embedding rows": rows, "activations": cache},
                                 "layers": {**process, "layer": w["layer_max"], "activations": activations, **train},
                                 "save": {**process, "tensor": max(w["layer_max"], largest_rest(w))}, **final}, device)


def estimate_export(w: dict[str, int], job: Workload) -> StageEstimate:
    """GGUF q8_0: the largest tensor read and quantized (the source tensor and its packed copy); then
    the parity check: PyTorch on the layer engine (the embedding, then one layer, the final norm
    and a block of the head, the logits), then llama.cpp with the whole file mapped. On CPU."""
    tensor = max(w["linear_max"], w["embed"], w["head"])
    logits = job.parity_tokens * w["vocab"] * FP32
    process = _process("export", w)
    return _stage("export", {
        "write": {**process, "tensor + packed": tensor + int(tensor / FP32 * Q8_0_BYTES)},
        "torch parity": {**process, "embedding rows or layer": max(embedding_rows_bytes(w, job.parity_tokens),
                                                                   w["layer_max"] + HEAD_BLOCK_BYTES), "logits": logits},
        "llama.cpp parity": {**process, "gguf file": gguf_bytes(w), "llama.cpp": LLAMA_CPP_BYTES + min(logits, LOGIT_BLOCK_BYTES),
                             "logits": 2 * logits}}, {})


def estimate_fidelity(w: dict[str, int], job: Workload) -> StageEstimate:
    """Every model embeds the windows (its embedding matrix read, used, dropped), then dense + PyTorch
    candidates are walked side by side (one activation cache each, one layer), their logits made one
    window at a time with the head read in blocks of vocabulary rows; then each runtime candidate
    alone, next to the dense model's cache."""
    cache = job.eval_windows * job.seqlen * w["hidden"] * FP32
    caches = (1 + job.torch_candidates) * cache
    logits = job.seqlen * w["vocab"] * FP32
    compare = 4 * ROW_CHUNK * w["vocab"] * 8  # float64 log-softmax chunks of both models
    process = _process("fidelity", w)
    phases = {"embed": {**process, "embedding rows": embedding_rows_bytes(w, job.eval_windows * job.seqlen), "caches": caches},
              "layers": {**process, "caches": caches, "layer": w["layer_max"]},
              "logits": {**process, "caches": caches, "head block": HEAD_BLOCK_BYTES, "logits": 2 * logits,
                         "compare": compare}}
    if job.zeroshot:  # one whole fp32 model at a time in the harness
        phases["zero-shot"] = {**process, "model": w["total"], "task logits": zeroshot_logit_bytes(job.zeroshot_batch, w["vocab"])}
    if job.runtime_candidates:
        phases["runtime"] = {**process, "cache": cache, "head block": HEAD_BLOCK_BYTES, "gguf file": gguf_bytes(w),
                             "llama.cpp": LLAMA_CPP_BYTES + min(logits, LOGIT_BLOCK_BYTES), "logits": 2 * logits,
                             "compare": compare}
    return _stage("fidelity", phases, {"layer": w["layer_max"], "head block": HEAD_BLOCK_BYTES,
                                       "batch": layer_batch_bytes(w, 8 * job.seqlen)})


def gguf_bytes(w: dict[str, int]) -> int:
    """Size of the Q8_0 export (what llama.cpp maps)."""
    return int(w["total"] / FP32 * Q8_0_BYTES)


def estimate_build(w: dict[str, int], job: Workload) -> list[StageEstimate]:
    """Every stage that holds model weights, in build order (the benchmark stage runs each
    exported model in a child process of its own, about the export's llama.cpp share)."""
    return [estimate_prune(w, job), estimate_compensate(w, job), estimate_export(w, job), estimate_fidelity(w, job)]
