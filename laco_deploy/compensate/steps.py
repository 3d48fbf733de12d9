"""How big a training step is, and its learning rate, for the device a run is given.

On a CPU a step of 2 samples already keeps the cores busy, and that is the default. On a GPU the
same step is overhead-bound: measured on an H200, the default model's LaCo step of 2 x 256 tokens
took 8.5 ms, almost all of it launching kernels and Python, so the walk ran 9 minutes where the
arithmetic needs seconds. So on an accelerator, unless compensate.batch_size is set, a step takes
about `gpu_tokens_per_step` tokens: the largest power-of-two batch up to that which
- fits the memory the device has free (a share of it: `memory_share`), as sizing.py sizes the layer
  step (the walk), the whole model's step (the LoRA baseline), or the final KL pass's (its own
  batch: one layer at a time, but its logits over the vocabulary), and
- still leaves `MIN_STEPS_PER_EPOCH` updates per epoch.
Fewer, larger steps get a larger learning rate: lr, final_kl_lr and lora_lr scale by
sqrt(batch / cpu_batch_size), the square-root rule for Adam (the noise of a gradient averaged over
k times more samples falls by sqrt(k)).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from laco_deploy import sizing
from laco_deploy.config import CompensateConfig
from laco_deploy.devices import Traits

MIN_STEPS_PER_EPOCH = 8  # a larger batch than samples / 8 leaves too few updates to train on


@dataclass(frozen=True)
class StepPlan:
    batch_size: int  # the walk's step (LoRA: its step)
    final_kl_batch_size: int  # the final KL pass's step (the whole model is resident: often smaller)
    lr_scale: float  # applied to lr and lora_lr
    final_kl_lr_scale: float
    reason: str  # one sentence for the log and the record

    def apply(self, cfg: CompensateConfig) -> CompensateConfig:
        """`cfg` with these batch sizes and the scaled learning rates (lr resolved: the family's when unset)."""
        if cfg.lr is None:
            raise ValueError("compensate.lr is unset: resolve it (families.layer_lr) before scaling it with the step")
        return dataclasses.replace(cfg, batch_size=self.batch_size, final_kl_batch_size=self.final_kl_batch_size,
                                   lr=cfg.lr * self.lr_scale, lora_lr=cfg.lora_lr * self.lr_scale,
                                   final_kl_lr=cfg.kl_lr * self.final_kl_lr_scale)


def layer_step_bytes(w: dict[str, int], tokens: int, dense_twin: bool) -> int:
    """Device bytes of the LaCo step on `tokens` tokens: the layer and its training state."""
    return w["layer_max"] + sum(sizing.layer_step_terms(w, tokens, dense_twin).values())


def whole_model_bytes(w: dict[str, int], tokens: int) -> int:
    """Device bytes of a step of the whole model (LoRA): weights, their training state, activations
    of every layer and the logits."""
    return w["total"] + sum(sizing.whole_model_terms(w, tokens).values())


def _largest_batch(cap: int, seqlen: int, need, room: int | None) -> int:
    """The largest power of two up to `cap` whose need(tokens) fits `room` (1 when none does:
    the run then reports what does not fit, e.g. distill.skip_reason)."""
    batch = 2 ** int(math.log2(max(1, cap)))
    while room is not None and batch > 1 and need(batch * seqlen) > room:
        batch //= 2
    return batch


def plan(cfg: CompensateConfig, seqlen: int, train_samples: int, w: dict[str, int] | None, traits: Traits,
         dense_twin: bool = False) -> StepPlan:
    """The steps for `train_samples` samples of `seqlen` tokens (the walk's; the final pass has as
    many by default) on a device with `traits`; `w`: sizing.weight_bytes of the model (None:
    unknown, memory is not checked)."""
    final = cfg.final_kl_batch_size
    if cfg.batch_size is not None or not traits.accelerator:
        batch = cfg.batch_size if cfg.batch_size is not None else cfg.cpu_batch_size
        why = "compensate.batch_size" if cfg.batch_size is not None else "the CPU default"
        return StepPlan(batch, final if final is not None else batch, 1.0, 1.0, f"batch {batch} ({why})")
    cap = min(max(1, cfg.gpu_tokens_per_step // seqlen), max(1, train_samples // MIN_STEPS_PER_EPOCH))
    room = int(cfg.memory_share * traits.free_bytes) if w is not None and traits.free_bytes is not None else None
    if cfg.method == "lora":
        batch = _largest_batch(cap, seqlen, lambda t: whole_model_bytes(w, t), room)
    else:
        batch = _largest_batch(cap, seqlen, lambda t: layer_step_bytes(w, t, dense_twin), room)
    if final is None:
        final = _largest_batch(cap, seqlen, lambda t: sizing.final_kl_device_bytes(w, t, cfg.final_kl_optimizer), room)
    scale, final_scale = math.sqrt(batch / cfg.cpu_batch_size), math.sqrt(final / cfg.cpu_batch_size)
    fits = f" within {cfg.memory_share:.0%} of {traits.free_bytes / 2**30:.1f} GiB free" if room is not None else ""
    return StepPlan(batch, final, scale, final_scale,
                    f"batch {batch} x {seqlen} tokens on the accelerator (at most {cfg.gpu_tokens_per_step} tokens, "
                    f"{MIN_STEPS_PER_EPOCH}+ steps per epoch{fits}), final KL pass batch {final}; learning rates "
                    f"x{scale:.3g} and x{final_scale:.3g} (square-root rule)")


def fits_on_device(w: dict[str, int], cfg: CompensateConfig, samples: int, seqlen: int, traits: Traits,
                   dense_twin: bool = False) -> bool:
    """Whether the walk's activation caches (two, or three where the step reads the dense inputs:
    engine.walk) stay on the device next to the layer step."""
    if not (cfg.device_caches and traits.accelerator) or traits.free_bytes is None or cfg.offload != "cpu":
        return False
    caches = (3 if dense_twin else 2) * sizing.activation_cache_bytes(w, samples, seqlen)
    need = caches + layer_step_bytes(w, cfg.batch_size * seqlen, dense_twin)
    return need <= cfg.memory_share * traits.free_bytes
