"""FLOPs of a training step, for the throughput report: counted from shapes, never fatal.

torch's FlopCounterMode counts the matmuls of a step from their shapes. Its attention formulas
have two gaps that matter here:
- grouped-query attention: transformers calls `scaled_dot_product_attention` with key/value
  heads fewer than the query's (`enable_gqa=True`, every Llama 3 / Qwen / Gemma / SmolLM2 model),
  and torch 2.11's formula asserts on those shapes inside the forward pass, ending the run (seen on
  CUDA; torch 2.13 counts them);
- CPU's fused attention kernel has no formula at all, so CPU runs counted no attention.
So every sdpa kernel (CUDA flash, memory-efficient and cuDNN, CPU flash) is counted here from the
shapes, over the query heads, grouped or not; and every formula runs guarded: one that still
raises makes the step "not counted" (a debug log line), never an error of the run.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, TypeVar

import torch
from torch.utils.flop_counter import FlopCounterMode

log = logging.getLogger(__name__)
T = TypeVar("T")
aten = torch.ops.aten

_FORWARD = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
            "_scaled_dot_product_fused_attention_overrideable")


def attention_flops(query_shape, key_shape, value_shape) -> int:
    """Forward FLOPs of softmax(Q K^T) V: query [b, h, s_q, d], key [b, h_kv, s_k, d], value
    [b, h_kv, s_k, d_v], h a multiple of h_kv (grouped query). Both products run over all h query
    heads (each group shares its key/value head); the causal mask's skipped half is counted, as
    torch does."""
    b, h, s_q, d = query_shape[-4:]
    s_k, d_v = key_shape[-2], value_shape[-1]
    return 2 * b * h * s_q * s_k * (d + d_v)


def attention_backward_flops(grad_out_shape, query_shape, key_shape, value_shape) -> int:
    """Backward FLOPs: the scores recomputed (Q K^T), then the gradients of the scores (dO V^T), of V
    (P^T dO), of Q (dS K) and of K (dS^T Q)."""
    b, h, s_q, d = query_shape[-4:]
    s_k, d_v = key_shape[-2], value_shape[-1]
    return 2 * b * h * s_q * s_k * (3 * d + 2 * d_v)


def _forward(query_shape, key_shape, value_shape, *_args, out_shape=None, **_kwargs) -> int:
    return attention_flops(query_shape, key_shape, value_shape)


def _backward(grad_out_shape, query_shape, key_shape, value_shape, *_args, out_shape=None, **_kwargs) -> int:
    return attention_backward_flops(grad_out_shape, query_shape, key_shape, value_shape)


def attention_formulas() -> dict[Any, Callable[..., int]]:
    """The sdpa kernels this torch build has -> our shape formulas (FlopCounterMode's custom_mapping)."""
    out: dict[Any, Callable[..., int]] = {}
    for name in _FORWARD:
        for op, formula in ((getattr(aten, name, None), _forward), (getattr(aten, name + "_backward", None), _backward)):
            if op is not None:
                out[op] = formula
    return out


class StepFlops:
    """Context manager counting the FLOPs of the forward and backward inside it.

    `total` is the count, or None when it could not be counted (`error` says why); the block itself
    always runs as it would without the counter, unless the counter breaks the dispatch itself (see
    `counted`)."""

    def __init__(self) -> None:
        self.total: int | None = None
        self.error: str | None = None
        self._mode: FlopCounterMode | None = None

    def _fail(self, where: str, e: BaseException) -> None:
        if self.error is None:
            self.error = f"{where}: {type(e).__name__}: {e}"
            log.debug("FLOPs not counted (%s)", self.error)

    def _guard(self, name: Any, formula: Callable[..., int]) -> Callable[..., int]:
        def guarded(*args, **kwargs) -> int:
            try:
                return formula(*args, **kwargs)
            except Exception as e:  # a measurement never ends a run
                self._fail(f"the FLOP formula of {name}", e)
                return 0
        return guarded

    def __enter__(self) -> StepFlops:
        try:
            mode = FlopCounterMode(display=False, custom_mapping=attention_formulas())
            registry = getattr(mode, "flop_registry", None)
            if isinstance(registry, dict):
                mode.flop_registry = {op: self._guard(op, f) for op, f in registry.items()}
            mode.__enter__()
            self._mode = mode
        except Exception as e:
            self._fail("starting the FLOP counter", e)
        return self

    def __exit__(self, *exc) -> bool:
        if self._mode is not None:
            try:
                self._mode.__exit__(*exc)
            except Exception as e:
                self._fail("stopping the FLOP counter", e)
            if self.error is None and exc[0] is None:
                self.total = int(self._mode.get_total_flops())
            self._mode = None
        return False


def counted(step: Callable[[], T], params: list[torch.Tensor]) -> tuple[T, int | None]:
    """Run `step` (a forward and backward) counting its FLOPs: (its result, FLOPs or None).

    Should the counter break the step itself (an error raised by the counting machinery rather
    than a formula), the gradients the failed attempt left on `params` are dropped and the step runs
    again uncounted, so an error that is the step's own still raises from there. Call it on a step
    that starts from no gradients (the first of an accumulation), as the trainers do."""
    counter = StepFlops()
    try:
        with counter:
            result = step()
    except Exception as e:
        counter._fail("the counted step", e)
        for p in params:
            p.grad = None
        return step(), None
    return result, counter.total
