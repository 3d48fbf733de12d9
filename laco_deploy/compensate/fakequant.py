"""Fake quantization for quantization-aware LaCo (`--quant-aware TYPE`).

During compensation the pruned linears of a layer compute with dequantize(quantize(W)), the
weights the target runtime will hold after export, while the gradient flows to W unchanged
(straight-through estimator). LaCo then repairs the quantization error together with the pruning
error. The saved weights stay plain float32 with their +0.0 mask; the exporter quantizes them.

Block schemes (weight [out, in] float32 -> same shape; blocks run along `in`, the row of a
GGUF tensor and the K axis of an ONNX MatMul, so the Q/K row reordering of the GGUF export
does not change them):

    q8_0   GGUF Q8_0: 32 values, fp16 scale amax / 127, C roundf (gguf-py's quantizer, bit-exact)
    q5_0   GGUF Q5_0: 32 values, fp16 scale max / -16, truncation of x / d + 16.5 (gguf-py, bit-exact)
    q4_0   GGUF Q4_0: 32 values, fp16 scale max / -8, truncation of x / d + 8.5 (gguf-py, bit-exact)
    q5_1   GGUF Q5_1: 32 values, fp16 step (max - min) / 31 and fp16 offset min, truncation of
           (x - min) / d + 0.5 (gguf-py, bit-exact)
    q2_k, q3_k, q4_k, q5_k, q6_k   GGUF k-quants: see compensate/kquants.py and kquants_low.py
           (llama.cpp's reference quantizers, bit-exact)
    f16    fp16 rounding (the GGUF fallback for rows that fit no block size)
    int8   ONNX int8: onnxruntime MatMulNBits, 8 bits, blocks of 32, symmetric, fp32 scale max / -128,
           code roundf(x / scale + 128) clamped to [0, 255] (what exporters/onnx.py writes, bit-exact)

A quant-aware TYPE names an export type and says which scheme each linear gets (`tensor_scheme`):
q8_0 and int8 are uniform; the GGUF k-quant types follow llama.cpp's per-tensor choice for the same
ftype (`llama_tensor_get_type` in src/llama-quant.cpp of the llama.cpp that llama-cpp-python
vendors; `_mix` below, e.g. Q6_K for attn_v and ffn_down in the layers `use_more_bits` picks in
Q4_K_M / Q5_K_M), then its fallback for rows that are not a multiple of 256 (`_FALLBACK`: Q2_K and
Q3_K -> Q4_0, Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, and F16 for rows not a multiple of 32), e.g.
the 576-wide rows of SmolLM2-135M; q4_k is Q4_K on every linear (with the same fallbacks).
tests/compensate/test_fakequant.py checks `_mix` against the types llama.cpp's quantizer writes.
Only the decoder linears are fake-quantized: the token embedding and output head, which llama.cpp
quantizes too (Q6_K for most ftypes), run in float during LaCo. Rules llama.cpp keeps for MoE,
Falcon and 70B models are not modelled (laco-deploy prunes none of them).
Symmetric schemes keep a zero weight exactly zero; the affine ones (Q2_K, Q4_K, Q5_K, Q5_1, with a
min offset) do not (kquants.py).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections import Counter
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

from laco_deploy.compensate.kquants import (QK_K, fp16_round, q4_k, q4_k_apply, q4_k_grid, q5_k, q5_k_apply, q5_k_grid,
                                            q6_k, q6_k_apply, q6_k_grid)
from laco_deploy.compensate.kquants_low import q2_k, q2_k_apply, q2_k_grid, q3_k, q3_k_apply, q3_k_grid
from laco_deploy.compensate.kquants_weighted import GRIDS as WEIGHTED_GRIDS
from laco_deploy.config import QUANT_AWARE
from laco_deploy.models import linear_modules

log = logging.getLogger(__name__)

QK = 32  # block size of Q8_0, Q5_0 and the ONNX int8 blocks


def roundf(x: torch.Tensor) -> torch.Tensor:
    """C roundf (halves away from zero), computed like gguf-py's np_roundf so it is exact in float32."""
    a = x.abs()
    f = a.floor()
    return torch.sign(x) * (f + torch.floor(2 * (a - f)))


def _inverse(d: torch.Tensor) -> torch.Tensor:
    """1 / d, and 0 where d is 0 (an all-zero block)."""
    safe = torch.where(d == 0, torch.ones_like(d), d)
    return torch.where(d == 0, torch.zeros_like(d), 1.0 / safe)


def q8_0(weight: torch.Tensor) -> torch.Tensor:
    """GGUF Q8_0 round trip. [out, in] with in % 32 == 0 -> [out, in]"""
    b = weight.reshape(-1, QK)
    d = b.abs().amax(1, keepdim=True) / 127
    q = roundf(b * _inverse(d))
    return (q * fp16_round(d)).reshape(weight.shape)


def _signed_peak(b: torch.Tensor) -> torch.Tensor:
    """The value of largest magnitude in each row, with its sign (the first one on ties). [n, k] -> [n, 1]"""
    return b.gather(1, b.abs().argmax(1, keepdim=True))


def q5_0(weight: torch.Tensor) -> torch.Tensor:
    """GGUF Q5_0 round trip. [out, in] with in % 32 == 0 -> [out, in]"""
    b = weight.reshape(-1, QK)
    d = _signed_peak(b) / -16
    q = torch.trunc(b * _inverse(d) + 16.5).clamp(0, 31)
    return ((q - 16) * fp16_round(d)).reshape(weight.shape)


def q4_0(weight: torch.Tensor) -> torch.Tensor:
    """GGUF Q4_0 round trip. [out, in] with in % 32 == 0 -> [out, in]"""
    b = weight.reshape(-1, QK)
    d = _signed_peak(b) / -8
    q = torch.trunc(b * _inverse(d) + 8.5).clamp(0, 15)
    return ((q - 8) * fp16_round(d)).reshape(weight.shape)


def q5_1(weight: torch.Tensor) -> torch.Tensor:
    """GGUF Q5_1 round trip (affine: x ~ d * q + min). [out, in] with in % 32 == 0 -> [out, in]"""
    b = weight.reshape(-1, QK)
    lo = b.amin(1, keepdim=True)
    d = (b.amax(1, keepdim=True) - lo) / 31
    q = torch.trunc((b - lo) * _inverse(d) + 0.5).clamp(0, 31)
    return (fp16_round(d) * q + fp16_round(lo)).reshape(weight.shape)


def f16(weight: torch.Tensor) -> torch.Tensor:
    return fp16_round(weight)


def int8_blocks(weight: torch.Tensor) -> torch.Tensor:
    """onnxruntime's symmetric 8-bit blockwise quantization (MatMulNBits, block 32) round trip.

    [out, in] -> [out, in]; a last partial block is padded with zeros, as the quantizer pads K.
    """
    out_f, in_f = weight.shape
    pad = -in_f % QK
    b = F.pad(weight, (0, pad)).reshape(-1, QK)
    scale = _signed_peak(b) / -128
    code = roundf(b * _inverse(scale) + 128).clamp(0, 255)
    deq = ((code - 128) * scale).reshape(out_f, in_f + pad)
    return deq[:, :in_f]


SCHEMES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "q8_0": q8_0, "q5_0": q5_0, "q4_0": q4_0, "q5_1": q5_1, "q2_k": q2_k, "q3_k": q3_k, "q4_k": q4_k,
    "q5_k": q5_k, "q6_k": q6_k, "f16": f16, "int8": int8_blocks,
}
_BLOCK = {**dict.fromkeys(("q8_0", "q5_0", "q4_0", "q5_1"), QK), **dict.fromkeys(("q2_k", "q3_k", "q4_k", "q5_k", "q6_k"), QK_K),
          "f16": 1, "int8": 1}
# llama.cpp's tensor_type_fallback (and F16 where the fallback does not fit either)
_FALLBACK = {"q2_k": "q4_0", "q3_k": "q4_0", "q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0",
             "q8_0": "f16", "q5_0": "f16", "q4_0": "f16", "q5_1": "f16"}


def fake_quantize(weight: torch.Tensor, scheme: str) -> torch.Tensor:
    """dequantize(quantize(weight)) in `scheme` (a key of SCHEMES), in float32. [out, in] -> [out, in]"""
    return SCHEMES[scheme](weight.detach().float()).to(weight.dtype)


def use_more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v / ffn_down get more bits in Q4_K_M / Q5_K_M."""
    return layer < num_layers // 8 or layer >= 7 * num_layers // 8 or (layer - num_layers // 8) % 3 == 2


# HF linear -> llama.cpp's tensor category, where a rule of _mix depends on it (a fused qkv_proj,
# Phi-3's attn_qkv, gets attn_v's rules in this llama.cpp)
_CATEGORY = {"v_proj": "attn_v", "qkv_proj": "attn_v", "o_proj": "attn_output", "down_proj": "ffn_down"}
# quant-aware type -> the type of the linears no rule changes (the ftype's default type)
_BASE = {"q8_0": "q8_0", "q4_k": "q4_k", "q6_k": "q6_k", "q2_k": "q2_k", "q3_k_s": "q3_k", "q3_k_m": "q3_k",
         "q4_k_m": "q4_k", "q4_k_s": "q4_k", "q5_k_s": "q5_k", "q5_k_m": "q5_k"}


def _mix(quant_aware: str, category: str, layer: int, num_layers: int, gqa: int) -> str | None:
    """llama.cpp's llama_tensor_get_type_impl for the decoder linears of a dense model: the type that
    replaces the ftype's default for this tensor, or None (q3_k_s, q5_k_s and q6_k have no rule; Q4_K_S's
    first four attn_v count attn_v tensors, which is the layer index in the models laco-deploy prunes)."""
    more = use_more_bits(layer, num_layers)
    rules = {
        "attn_v": {"q2_k": "q4_k" if gqa >= 4 else "q3_k", "q3_k_m": "q5_k" if layer < 2 else "q4_k",
                   "q4_k_s": "q5_k" if layer < 4 else None,
                   "q4_k_m": "q6_k" if more else None, "q5_k_m": "q6_k" if more else None},
        "ffn_down": {"q2_k": "q3_k", "q3_k_m": "q5_k" if layer < num_layers // 16 else "q4_k",
                     "q4_k_s": "q5_k" if layer < num_layers // 8 else None,
                     "q4_k_m": "q6_k" if more else None, "q5_k_m": "q6_k" if more else None},
        "attn_output": {"q2_k": "q3_k", "q3_k_m": "q4_k"},
    }
    return rules.get(category, {}).get(quant_aware)


def tensor_scheme(quant_aware: str, module: str, layer: int, num_layers: int, in_features: int, *, gqa: int) -> str:
    """The scheme the export of type `quant_aware` applies to linear `module` (e.g. `mlp.down_proj`)
    of decoder layer `layer`, whose rows are `in_features` long, in a model with `gqa` query heads
    per KV head (llama.cpp's n_gqa(), which only Q2_K's attn_v rule reads)."""
    if quant_aware == "int8":
        return "int8"
    category = _CATEGORY.get(module.rsplit(".", 1)[-1], "")
    base = _mix(quant_aware, category, layer, num_layers, gqa) or _BASE[quant_aware]
    while in_features % _BLOCK[base]:
        base = _FALLBACK[base]
    return base


def _gqa(layers: list[torch.nn.Module]) -> int:
    """Query heads per KV head of the first decoder layer (llama.cpp's n_gqa() reads layer 0; pruning
    removes whole KV groups, so the ratio is the model's); 1 where the layer does not say."""
    return int(getattr(getattr(layers[0], "self_attn", None), "num_key_value_groups", 1)) if layers else 1


# k-quants split into a costly grid search and a cheap rounding onto the grid (kquants.py)
_GRIDS = {"q2_k": (q2_k_grid, q2_k_apply), "q3_k": (q3_k_grid, q3_k_apply), "q4_k": (q4_k_grid, q4_k_apply),
          "q5_k": (q5_k_grid, q5_k_apply), "q6_k": (q6_k_grid, q6_k_apply)}
GRID_REUSE = 8  # training steps that round onto the last k-quant grid before it is searched again


def _weighted(grid: Callable, importance: torch.Tensor, weight: torch.Tensor):
    return grid(weight, importance)


class _ActiveLayer:
    """Only the layer that runs keeps its quantized weights: entering another layer frees those of
    the previous one (LaCo visits layers in order; a copy per layer would add a model's worth of RAM)."""

    def __init__(self):
        self.index: int | None = None
        self.members: dict[int, list[_Quantizer]] = {}

    def enter(self, index: int) -> None:
        if self.index is not None and self.index != index:
            for q in self.members.get(self.index, []):
                q.clear()
        self.index = index


class _Quantizer:
    """The fake-quantized weight of one linear, recomputed only when the weight changed.

    Without gradients (evaluation, propagation) the result is always the exporter's. In training
    steps a k-quant's grid search (several times the cost of a training step of a SmolLM2-135M layer) runs every
    GRID_REUSE steps; in between the changed weights are rounded onto the last grid with the
    exporter's rounding. Block-absmax schemes are exact in every step.
    """

    def __init__(self, scheme: str, layer: int, active: "_ActiveLayer", importance: torch.Tensor | None = None):
        self.scheme, self.layer, self.active = scheme, layer, active
        # an importance per input column [in]: llama.cpp's weighted search (export with that imatrix)
        self.importance = importance if importance is not None and scheme in WEIGHTED_GRIDS else None
        self.clear()

    def clear(self) -> None:
        self._key: tuple | None = None
        self._exact = False
        self._value: torch.Tensor | None = None
        self._grid = None
        self._grid_uses = 0

    def _quantize(self, weight: torch.Tensor, exact: bool) -> torch.Tensor:
        if self.importance is not None:
            grid, apply = WEIGHTED_GRIDS[self.scheme]
            search = functools.partial(_weighted, grid, self.importance.to(weight.device))
        elif self.scheme in _GRIDS:
            search, apply = _GRIDS[self.scheme]
        else:
            return SCHEMES[self.scheme](weight)
        if exact or self._grid is None or self._grid_uses >= GRID_REUSE:
            self._grid, self._grid_uses = search(weight), 0
        self._grid_uses += 1
        return apply(weight, self._grid)

    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        training = weight.requires_grad and torch.is_grad_enabled()
        key = (weight.data_ptr(), weight._version, weight.device, weight.dtype)
        if key != self._key or (not training and not self._exact):
            self.active.enter(self.layer)
            with torch.no_grad():
                self._value = self._quantize(weight.detach().float(), exact=not training).to(weight.dtype)
            self._key, self._exact = key, not training
        if not training:
            return self._value
        # straight-through: the value is exactly the quantized weight (w - w is +0.0), d/dW = identity
        return self._value + (weight - weight.detach())


def _fake_forward(lin: torch.nn.Linear, quantizer: _Quantizer, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, quantizer(lin.weight), lin.bias)


@contextlib.contextmanager
def fake_quantized(layers: list[torch.nn.Module], quant_aware: str | None, targets: tuple[str, ...],
                   importance: dict[str, torch.Tensor] | None = None) -> Iterator[dict[str, str]]:
    """Make the target linears of all decoder `layers` of a model (in order: the scheme can depend
    on the layer index) compute with fake-quantized weights; restore them on exit.

    `importance`: {"<layer>.<module>": [in] mean squared input} (an importance matrix, as
    imatrix.linear_importance reads it): those linears quantize as llama.cpp does with it
    (kquants_weighted.py; Q8_0 and F16 take none), the others unweighted.

    Yields {"<layer>.<module>": scheme}. `quant_aware` None: does nothing. The linears keep their
    Parameter objects (optimizers, masks and checkpoints see plain weights); only their forward
    is replaced for the duration.
    """
    if quant_aware is None:
        yield {}
        return
    if quant_aware not in QUANT_AWARE:
        raise ValueError(f"unknown quant-aware type {quant_aware!r}; choose from {', '.join(QUANT_AWARE)}")
    installed: list[torch.nn.Linear] = []
    schemes: dict[str, str] = {}
    active = _ActiveLayer()
    gqa = _gqa(layers)
    try:
        for index, layer in enumerate(layers):
            for name, lin in linear_modules(layer, targets).items():
                scheme = tensor_scheme(quant_aware, name, index, len(layers), lin.in_features, gqa=gqa)
                quantizer = _Quantizer(scheme, index, active, (importance or {}).get(f"{index}.{name}"))
                active.members.setdefault(index, []).append(quantizer)
                lin.forward = functools.partial(_fake_forward, lin, quantizer)
                installed.append(lin)
                schemes[f"{index}.{name}"] = scheme
        weighted = sum(q.importance is not None for qs in active.members.values() for q in qs)
        log.info("quant-aware %s: linears compute with fake-quantized weights (%s)%s", quant_aware,
                 ", ".join(f"{n} {s}" for s, n in sorted(Counter(schemes.values()).items())),
                 f", {weighted} of them importance-weighted" if importance else "")
        yield schemes
    finally:
        for lin in installed:
            del lin.forward  # back to the class's Linear.forward
