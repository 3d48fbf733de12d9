"""llama.cpp's k-quants Q4_K, Q5_K and Q6_K as pure tensor functions: weight -> dequantize(quantize(weight)).

The arithmetic follows ggml's reference quantizers (`quantize_row_q4_K_ref`, `quantize_row_q5_K_ref`,
`quantize_row_q6_K_ref` in ggml-quants.c, used by `llama_model_quantize` when no importance matrix
is given), vectorized over all blocks of a matrix; rows are split into super-blocks of QK_K = 256
values. Q2_K and Q3_K are in kquants_low.py.

- Q4_K / Q5_K: 8 sub-blocks of 32, each x ~ d * sc_j * q - dmin * m_j with 4-bit / 5-bit q, 6-bit
  sc_j and m_j and fp16 d, dmin per super-block. Each sub-block's (scale, min) comes from a grid
  search (21 steps from rmin -1 / 16 steps from rmin -0.5) that refits both by weighted least
  squares (`make_qkx2_quants`, weights av|x| + |x|).
- Q6_K: 16 sub-blocks of 16, x ~ d * sc_j * q with 6-bit q in [-32, 31], int8 sc_j and fp16 d; each
  sub-block's scale from a 19-step search weighted by x^2 (`make_qx_quants`, rmse_type 1).

Exactness: the C loops accumulate each sub-block's sums one element at a time in float32 (no fused
multiply-add in the build llama-cpp-python makes: emulating one made far more values differ), so
the sums here run in that order too (`_seq_sum`); torch's vectorized sums, which add in another
order, flipped near-ties of the grid search in ~1% of the values. Two more torch habits moved rare
near-ties: `c / t` is computed as c * (1 / t) (two roundings; `_f32(c) / t` divides), and its
vectorized float32 sqrt can be one ulp off (`sqrtf` takes the float64 root). With the three
matched, Q2_K, Q3_K, Q4_K, Q5_K and Q6_K equal llama.cpp's own quantizer bit for bit, measured on
this project's 2-core VM (llama-cpp-python 0.3.36, ggml 0.25.3): 0 differing values per type in
786,432 (tests/compensate/test_kquants_low.py: `ggml_quantize_chunk` of the libggml-base it ships,
on pruned outlier-heavy, all non-negative and dense unit-scale matrices), in 9.3 million more of a
one-off run (4 seeds and scales), and in every linear of the GGUF files llama.cpp writes for
Q2_K, Q3_K_S/M, Q4_K_M, Q5_K_S/M (read back). Before the last two fixes Q4_K differed in one
sub-block of 32 values in ~4 million (Q5_K in 249 of 32,768 values: one super-block; Q2_K in 230
values of 884,736); tests/compensate/test_fakequant.py still bounds Q4_K as a margin across machines.

Zeros: Q6_K is symmetric, so a pruned (zero) weight dequantizes to 0. Q4_K and Q5_K are affine (a
min per sub-block): a zero comes back as d * sc * round(m / sc / d) - m, generally a small non-zero
value, exactly as llama.cpp will run it. The stored weights keep their +0.0 either way; only the
forward pass sees the runtime's values.
"""

from __future__ import annotations

import functools

import torch

QK_K = 256  # values per super-block
_EPS = 1e-15  # GROUP_MAX_EPS: a (sub-)block whose largest |x| is below this is all zero


def fp16_round(x: torch.Tensor) -> torch.Tensor:
    """Round float32 to the nearest fp16 value and back (GGML_FP32_TO_FP16 / FP16_TO_FP32)."""
    return x.to(torch.float16).to(torch.float32)


def nearest_int(x: torch.Tensor) -> torch.Tensor:
    """ggml's nearest_int: float32 round to nearest, ties to even (the 1.5 * 2^23 addition trick)."""
    return torch.round(x)


def sqrtf(x: torch.Tensor) -> torch.Tensor:
    """C sqrtf, correctly rounded: the float64 root rounded to float32 (torch's vectorized float32
    sqrt is off by one ulp on some inputs, which moved Q4_K/Q5_K grid searches onto another candidate)."""
    return torch.sqrt(x.double()).float()


def _f32(value: float) -> torch.Tensor:
    """A float32 constant as a tensor: `_f32(c) / t` divides, where torch computes `c / t` as
    c * (1 / t), two roundings, which moved near-ties of the searches off llama.cpp's."""
    return torch.tensor(value, dtype=torch.float32)


def _seq_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over dim 0 one element after the other in float32, as the C loops accumulate: [k, n] -> [1, n].
    (torch's own sums and cumsum use other orders or float64, which flips near-ties of the searches.)"""
    acc = t[0].clone()
    for row in t[1:]:
        acc += row
    return acc.unsqueeze(0)


def _qkx2_scale_min(x: torch.Tensor, w: torch.Tensor, nmax: int, rmin: float, rdelta: float,
                    nstep: int, mad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`make_qkx2_quants` on many sub-blocks at once: x, w [k, n], one sub-block of k values per
    column -> (scale [1, n], min [1, n]); `mad` is its use_mad (weighted |error| instead of error^2).
    With weights given, ggml's `make_qkx3_quants` is the same search (kquants_weighted.py).

    The returned min is positive and subtracted: x ~ scale * q - min."""
    scale, lo, _, _ = qkx_search(x, w, nmax, rmin, rdelta, nstep, mad)
    return scale, -lo


def qkx_search(x: torch.Tensor, w: torch.Tensor, nmax: int, rmin: float, rdelta: float, nstep: int,
               mad: bool = False) -> tuple[torch.Tensor, ...]:
    """The search of `_qkx2_scale_min` -> (scale, offset (<= 0, added), and the inverse scale and
    offset whose rounding clamp(round(iscale * (x - offset)), 0, nmax) gave the best codes), each [1, n].

    The search keeps the best (scale, min) so far and later steps start from it, as the C loop does.
    """
    loss = torch.abs if mad else torch.square
    lo = x.amin(0, keepdim=True).clamp(max=0.0)
    hi = x.amax(0, keepdim=True)
    sum_w = _seq_sum(w)
    sum_x = _seq_sum(w * x)
    flat = hi == lo
    span = torch.where(flat, torch.ones_like(hi), hi - lo)
    iscale = _f32(nmax) / span
    scale = _f32(1.0) / iscale
    code_iscale, code_lo = iscale, lo
    q = nearest_int(iscale * (x - lo)).clamp(0, nmax)
    best = _seq_sum(w * loss(scale * q + lo - x))
    for step in range(nstep + 1):
        factor = _f32(rmin) + _f32(rdelta) * step + nmax
        span = torch.where(flat, torch.ones_like(hi), hi - lo)
        this_iscale = factor / span
        q = nearest_int(this_iscale * (x - lo)).clamp(0, nmax)
        wq = w * q
        sum_l, sum_l2, sum_xl = _seq_sum(wq), _seq_sum(wq * q), _seq_sum(wq * x)
        det = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
        positive = this_min > 0
        this_scale = torch.where(positive, sum_xl / sum_l2, this_scale)
        this_min = torch.where(positive, torch.zeros_like(this_min), this_min)
        err = _seq_sum(w * loss(this_scale * q + this_min - x))
        better = (det > 0) & (err < best) & ~flat
        best = torch.where(better, err, best)
        code_iscale, code_lo = torch.where(better, this_iscale, code_iscale), torch.where(better, lo, code_lo)
        scale = torch.where(better, this_scale, scale)
        lo = torch.where(better, this_min, lo)
    scale = torch.where(flat, torch.zeros_like(scale), scale)
    return scale, lo, code_iscale, code_lo


def _six_bit(values: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """`uint8_t l = nearest_int(inv * v); l = MIN(63, l)` (a negative result wraps as uint8 does)."""
    q = nearest_int(inv * values)
    q = torch.where(q < 0, q + 256, q)
    return q.clamp(max=63)


def _k32_grid(weight: torch.Tensor, nmax: int, rmin: float, nstep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The grid of Q4_K (nmax 15) or Q5_K (nmax 31) of a float32 matrix (rows a multiple of 256 long):
    per sub-block of 32 the step d * sc_j and the offset dmin * m_j, as float32.
    [out, in] -> ([blocks, 8, 1], [blocks, 8, 1])"""
    sub = weight.reshape(-1, 32).T.contiguous()  # [32, sub-blocks]
    av_x = sqrtf(_seq_sum(sub.square()) / 32)
    scales, mins = _qkx2_scale_min(sub, av_x + sub.abs(), nmax=nmax, rmin=rmin, rdelta=0.1, nstep=nstep)
    scales, mins = scales.reshape(-1, QK_K // 32), mins.reshape(-1, QK_K // 32)  # [super-blocks, 8]
    max_scale = scales.amax(1, keepdim=True).clamp(min=0.0)
    max_min = mins.amax(1, keepdim=True).clamp(min=0.0)
    inv_scale = torch.where(max_scale > 0, _f32(63.0) / max_scale, torch.zeros_like(max_scale))
    inv_min = torch.where(max_min > 0, _f32(63.0) / max_min, torch.zeros_like(max_min))
    d = fp16_round(max_scale / 63.0) * _six_bit(scales, inv_scale)
    dm = fp16_round(max_min / 63.0) * _six_bit(mins, inv_min)
    return d.unsqueeze(-1), dm.unsqueeze(-1)


def affine_apply(weight: torch.Tensor, grid: tuple[torch.Tensor, torch.Tensor], nmax: int) -> torch.Tensor:
    """Round `weight` onto an affine k-quant grid (codes q in [0, nmax], x ~ d * q - dm; sub-blocks
    of weight.numel() / d.numel() values) and dequantize. [out, in] -> [out, in]"""
    d, dm = grid
    x = weight.reshape(*d.shape[:2], -1)
    zero = d == 0
    q = nearest_int((x + dm) / torch.where(zero, torch.ones_like(d), d)).clamp(0, nmax)
    q = torch.where(zero, torch.zeros_like(q), q)
    return (d * q - dm).reshape(weight.shape)


def q4_k_grid(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The Q4_K grid (`quantize_row_q4_K_ref`: 4-bit q, search rmin -1, 21 steps). [out, in] -> ([blocks, 8, 1],) * 2"""
    return _k32_grid(weight, nmax=15, rmin=-1.0, nstep=20)


def q5_k_grid(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The Q5_K grid (`quantize_row_q5_K_ref`: 5-bit q, search rmin -0.5, 16 steps). [out, in] -> ([blocks, 8, 1],) * 2"""
    return _k32_grid(weight, nmax=31, rmin=-0.5, nstep=15)


# apply(weight, grid): round onto the grid's 4-bit / 5-bit codes q (x ~ d * q - dm) and dequantize
q4_k_apply = functools.partial(affine_apply, nmax=15)
q5_k_apply = functools.partial(affine_apply, nmax=31)


def q4_k(weight: torch.Tensor) -> torch.Tensor:
    """Q4_K round trip of a float32 matrix whose rows are a multiple of 256 long. [out, in] -> [out, in]"""
    return q4_k_apply(weight, q4_k_grid(weight))


def q5_k(weight: torch.Tensor) -> torch.Tensor:
    """Q5_K round trip of a float32 matrix whose rows are a multiple of 256 long. [out, in] -> [out, in]"""
    return q5_k_apply(weight, q5_k_grid(weight))


def _qx_search(x: torch.Tensor, nmax: int, qw: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`make_qx_quants(n, nmax, x, L, rmse_type=1, qw)` on each column (one sub-block of k values):
    the weighted best scale and the inverse scale whose rounding gave the codes L (the best
    candidate's). Weights `qw` [k, n] (an importance matrix), or x^2 where None. x [k, n] -> ([1, n], [1, n])"""
    idx = x.abs().argmax(0, keepdim=True)
    peak = x.gather(0, idx)  # the signed value of largest magnitude (first one on ties)
    empty = peak.abs() < _EPS
    peak = torch.where(empty, torch.ones_like(peak), peak)
    w = x * x if qw is None else qw

    def sums(iscale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = nearest_int(iscale * x).clamp(-nmax, nmax - 1)
        return _seq_sum(w * x * q), _seq_sum(w * q * q)

    best_iscale = _f32(-nmax) / peak
    sumlx, suml2 = sums(best_iscale)
    scale = torch.where(suml2 != 0, sumlx / torch.where(suml2 != 0, suml2, torch.ones_like(suml2)),
                        torch.zeros_like(sumlx))
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        iscale = -(nmax + _f32(0.1) * step) / peak
        sumlx, suml2 = sums(iscale)
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        new_scale = sumlx / torch.where(suml2 > 0, suml2, torch.ones_like(suml2))
        scale = torch.where(better, new_scale, scale)
        best_iscale = torch.where(better, iscale, best_iscale)
        best = torch.where(better, scale * sumlx, best)
    return torch.where(empty, torch.zeros_like(scale), scale), best_iscale


def q6_k_scales_to_grid(scales: torch.Tensor) -> torch.Tensor:
    """Q6_K's int8 sub-block scales under one fp16 d per super-block: scales [super-blocks, 16] -> [blocks, 16, 1]"""
    idx = scales.abs().argmax(1, keepdim=True)
    peak = scales.gather(1, idx)
    empty = peak.abs() < _EPS
    iscale = _f32(-128.0) / torch.where(empty, torch.ones_like(peak), peak)
    sc = nearest_int(iscale * scales).clamp(max=127)
    d = fp16_round(_f32(1.0) / iscale) * sc
    return torch.where(empty, torch.zeros_like(d), d).unsqueeze(-1)


def q6_k_grid(weight: torch.Tensor) -> torch.Tensor:
    """The Q6_K grid of a float32 matrix (rows a multiple of 256 long): the step d * sc_j of each
    sub-block of 16, float32. [out, in] -> [blocks, 16, 1]"""
    scales = _qx_search(weight.reshape(-1, 16).T.contiguous(), nmax=32)[0].reshape(-1, QK_K // 16)  # [super-blocks, 16]
    return q6_k_scales_to_grid(scales)


def symmetric_apply(weight: torch.Tensor, grid: torch.Tensor, qmin: int, qmax: int) -> torch.Tensor:
    """Round `weight` onto a symmetric k-quant grid (codes q in [qmin, qmax], x ~ d * q; sub-blocks of
    weight.numel() / grid.numel() values) and dequantize. [out, in] -> [out, in]"""
    x = weight.reshape(*grid.shape[:2], -1)
    zero = grid == 0
    q = nearest_int(x / torch.where(zero, torch.ones_like(grid), grid)).clamp(qmin, qmax)
    return torch.where(zero, torch.zeros_like(x), grid * q).reshape(weight.shape)


q6_k_apply = functools.partial(symmetric_apply, qmin=-32, qmax=31)  # codes q in [-32, 31], x ~ d * q


def q6_k(weight: torch.Tensor) -> torch.Tensor:
    """Q6_K round trip of a float32 matrix whose rows are a multiple of 256 long. [out, in] -> [out, in]"""
    return q6_k_apply(weight, q6_k_grid(weight))
