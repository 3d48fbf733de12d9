"""llama.cpp's importance-weighted quantizers as pure tensor functions: (weight, importance) -> grid.

What ggml's `quantize_q2_K` ... `quantize_q6_K`, `quantize_q4_0`, `quantize_q5_0` and `quantize_q5_1`
compute when given quant_weights (an importance matrix: one value per input column, the mean
squared input of `llama-imatrix`, as `export --imatrix` passes it), vectorized over all blocks of a
matrix with the sums in the C loops' order (kquants.py explains why):

- per-value weights qw_j * sqrt(sigma2 + x^2), sigma2 the mean square of the super-block (Q2_K),
  twice it (Q3_K, Q4_K, Q5_K) or of the whole row (Q4_0, Q5_0, Q5_1); Q6_K weights by qw_j alone.
- Q2_K / Q4_K / Q5_K: each sub-block's (scale, min) by `make_qkx3_quants` (the weighted search of
  kquants.qkx_search, rmin -0.9, 37 steps of 0.05), then the super-block's sub-block scales and mins
  themselves by `make_qp_quants` (a 9-step search and coordinate descent weighted by the sub-blocks'
  summed weights) instead of the max-based codes of the reference quantizers; then the values are
  rounded onto the final grid, as without weights (kquants.affine_apply).
- Q3_K: each sub-block's scale by the weighted `make_qx_quants` and the super-block's by another
  `make_qx_quants` over the scales (weights: summed per sub-block); Q6_K: the weighted sub-block
  search, then the reference's super-block step (kquants.q6_k_scales_to_grid).
- Q4_0 / Q5_0 / Q5_1: one search per block of 32 and no rounding onto the fp16 scale afterwards: the
  codes are those of the search's best inverse scale, so their grid keeps it (`coded_apply`).

    GRIDS[scheme] = (grid(weight [out, in], importance [in]), apply(weight, grid))

Exactness against ggml_quantize_chunk with the same importance: tests/compensate/test_kquants_weighted.py.
"""

from __future__ import annotations

import functools

import torch

from laco_deploy.compensate.kquants import (QK_K, _EPS, _f32, _qx_search, _seq_sum, affine_apply, fp16_round,
                                            nearest_int, q6_k_scales_to_grid, qkx_search, sqrtf, symmetric_apply)
from laco_deploy.compensate.kquants_low import descend


def _columns(t: torch.Tensor, size: int) -> torch.Tensor:
    """[out, in] -> [size, blocks]: one block of `size` consecutive row values per column."""
    return t.reshape(-1, size).T.contiguous()


def _value_weights(weight: torch.Tensor, importance: torch.Tensor, size: int, span: int, factor: int) -> torch.Tensor:
    """qw * sqrtf(sigma2 + x^2) per value, sigma2 = factor * (sum of x^2 over `span` values) / span,
    in blocks of `size` as columns. [out, in] -> [size, blocks]"""
    qw = _columns(importance.to(weight.dtype).expand_as(weight), size)
    sq = _seq_sum(_columns(weight.square(), span))  # [1, groups]
    sigma2 = (sq * factor) / torch.full_like(sq, float(span))
    sigma2 = sigma2.reshape(-1, 1).expand(-1, span // size).reshape(1, -1)  # one per block of `size`
    x = _columns(weight, size)
    return qw * sqrtf(sigma2 + x * x)


def _u8(t: torch.Tensor) -> torch.Tensor:
    """An int stored in a C uint8_t (negative values wrap)."""
    return torch.where(t < 0, t + 256, t)


def _qp(x: torch.Tensor, w: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`make_qp_quants(k, nmax, x, L, w)` on each column: the scale of non-negative values x [k, n]
    (sub-block scales or mins) and their uint8 codes L. -> ([1, n], [k, n])"""
    peak = x.amax(0, keepdim=True).clamp(min=0.0)
    empty = peak < _EPS
    peak = torch.where(empty, torch.ones_like(peak), peak)
    iscale = _f32(nmax) / peak
    codes = _u8(nearest_int(iscale * x))
    scale = _f32(1.0) / iscale
    diff = x - scale * codes
    best = _seq_sum(w * diff * diff)
    for step in (-4, -3, -2, -1, 1, 2, 3, 4):
        iscale_is = (_f32(0.1) * step + nmax) / peak
        diff = x - (_f32(1.0) / iscale_is) * nearest_int(iscale_is * x).clamp(max=nmax)
        mse = _seq_sum(w * diff * diff)
        better = mse < best
        best, iscale = torch.where(better, mse, best), torch.where(better, iscale_is, iscale)
    ints = nearest_int(iscale * x).clamp(max=nmax)
    sumlx, suml2 = _seq_sum(w * x * ints)[0], _seq_sum(w * ints * ints)[0]
    codes = _u8(ints)
    codes, sumlx, suml2 = descend(x, w, codes, sumlx, suml2, qmin=None, qmax=nmax)
    scale = torch.where(suml2 > 0, sumlx / torch.where(suml2 > 0, suml2, torch.ones_like(suml2)), torch.zeros_like(sumlx))
    return torch.where(empty[0], torch.zeros_like(scale), scale).unsqueeze(0), codes


def _affine_subblocks(weight: torch.Tensor, importance: torch.Tensor, size: int, nmax: int,
                      factor: int) -> tuple[torch.Tensor, ...]:
    """make_qkx3_quants on every sub-block of `size`, then make_qp_quants over each super-block's
    scales and mins (nmax 15 for Q2_K's 4-bit codes, 63 for Q4_K/Q5_K's 6-bit ones).
    -> (d [super-blocks, 1], scale codes, dmin, min codes [super-blocks, subs]) before packing"""
    x = _columns(weight, size)
    w = _value_weights(weight, importance, size, QK_K, factor)
    scales, lo, _, _ = qkx_search(x, w, nmax, rmin=-0.9, rdelta=0.05, nstep=36)
    subs = QK_K // size
    sw = _seq_sum(w).reshape(-1, subs).T.contiguous()  # [subs, super-blocks]
    code_max = 15 if size == 16 else 63
    d, ls = _qp(scales.reshape(-1, subs).T.contiguous(), sw, code_max)
    dm, lm = _qp((-lo).reshape(-1, subs).T.contiguous(), sw, code_max)
    return d.T, ls.T.long(), dm.T, lm.T.long()


def q2_k_grid(weight: torch.Tensor, importance: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_row_q2_K_impl`: the weighted Q2_K grid. [out, in], [in] -> ([blocks, 16, 1],) * 2"""
    d, ls, dm, lm = _affine_subblocks(weight, importance, 16, nmax=3, factor=1)
    packed = (ls & 0xFF) | ((lm << 4) & 0xFF)  # the uint8 `scales[j]`
    step = fp16_round(d) * (packed & 0xF)
    offset = fp16_round(dm) * (packed >> 4)
    return step.unsqueeze(-1), offset.unsqueeze(-1)


def _k4_codes(ls: torch.Tensor, lm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 6-bit scale and min codes as `get_scale_min_k4` reads them back from the 12 packed
    bytes (codes above 63, from a wrapped negative, spill into a neighbour's high bits as in C)."""
    ls, lm = ls & 0xFF, lm & 0xFF
    sc, m = ls & 63, lm & 63
    hi_s = (((ls[:, :4] >> 6) | (ls[:, 4:] >> 4)) & 3) << 4
    hi_m = (((lm[:, :4] >> 6) | (lm[:, 4:] >> 4)) & 3) << 4
    sc = torch.cat([sc[:, :4], (ls[:, 4:] & 0xF) | hi_s], 1)
    m = torch.cat([m[:, :4], (lm[:, 4:] & 0xF) | hi_m], 1)
    return sc, m


def _k32_grid(weight: torch.Tensor, importance: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    d, ls, dm, lm = _affine_subblocks(weight, importance, 32, nmax=nmax, factor=2)
    if nmax == 31:  # quantize_row_q5_K_impl clamps the uint8 codes to 63 before packing
        ls, lm = (ls & 0xFF).clamp(max=63), (lm & 0xFF).clamp(max=63)
    sc, m = _k4_codes(ls, lm)
    return (fp16_round(d) * sc).unsqueeze(-1), (fp16_round(dm) * m).unsqueeze(-1)


def q4_k_grid(weight: torch.Tensor, importance: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_row_q4_K_impl`: the weighted Q4_K grid. [out, in], [in] -> ([blocks, 8, 1],) * 2"""
    return _k32_grid(weight, importance, 15)


def q5_k_grid(weight: torch.Tensor, importance: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_row_q5_K_impl`: the weighted Q5_K grid. [out, in], [in] -> ([blocks, 8, 1],) * 2"""
    return _k32_grid(weight, importance, 31)


def q3_k_grid(weight: torch.Tensor, importance: torch.Tensor) -> torch.Tensor:
    """`quantize_row_q3_K_impl`: the weighted Q3_K grid. [out, in], [in] -> [blocks, 16, 1]"""
    x = _columns(weight, 16)
    w = _value_weights(weight, importance, 16, QK_K, factor=2)
    scales = _qx_search(x, 4, w)[0].reshape(-1, 16).T.contiguous()  # [16, super-blocks]
    sw = _seq_sum(w).reshape(-1, 16).T.contiguous()
    d_block, iscale = _qx_search(scales, 32, sw)
    sc = nearest_int(iscale * scales).clamp(-32, 31)  # the codes make_qx_quants stores (+ 32), read back - 32
    return (fp16_round(d_block) * sc).T.unsqueeze(-1)


def q6_k_grid(weight: torch.Tensor, importance: torch.Tensor) -> torch.Tensor:
    """`quantize_row_q6_K_impl`: sub-block scales weighted by the importance alone. [out, in], [in] -> [blocks, 16, 1]"""
    qw = _columns(importance.to(weight.dtype).expand_as(weight), 16)
    scales = _qx_search(_columns(weight, 16), 32, qw)[0].reshape(-1, QK_K // 16)
    return q6_k_scales_to_grid(scales)


def _symmetric_block_grid(weight: torch.Tensor, importance: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_row_q4_0_impl` (nmax 8) / `q5_0_impl` (16): per block of 32 the fp16 scale and the
    inverse scale its codes were rounded with. [out, in], [in] -> ([blocks, 1, 1],) * 2"""
    w = _value_weights(weight, importance, 32, weight.shape[1], factor=1)
    scale, iscale = _qx_search(_columns(weight, 32), nmax, w)
    return fp16_round(scale).reshape(-1, 1, 1), iscale.reshape(-1, 1, 1)


def coded_apply(weight: torch.Tensor, grid: tuple[torch.Tensor, torch.Tensor], nmax: int) -> torch.Tensor:
    """Q4_0 / Q5_0 from a weighted search: d * clamp(round(iscale * x), -nmax, nmax - 1). [out, in] -> [out, in]"""
    d, iscale = grid
    x = weight.reshape(d.shape[0], 1, -1)
    return (d * nearest_int(iscale * x).clamp(-nmax, nmax - 1)).reshape(weight.shape)


def q5_1_grid(weight: torch.Tensor, importance: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`quantize_row_q5_1_impl`: fp16 step and offset per block of 32 and the search's code rounding
    (inverse scale, offset). [out, in], [in] -> ([blocks, 1, 1],) * 4"""
    w = _value_weights(weight, importance, 32, weight.shape[1], factor=1)
    scale, lo, code_iscale, code_lo = qkx_search(_columns(weight, 32), w, 31, rmin=-0.9, rdelta=0.05, nstep=36)
    return tuple(t.reshape(-1, 1, 1) for t in (fp16_round(scale), fp16_round(lo), code_iscale, code_lo))


def q5_1_apply(weight: torch.Tensor, grid: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """d * clamp(round(iscale * (x - lo)), 0, 31) + m. [out, in] -> [out, in]"""
    d, m, iscale, lo = grid
    x = weight.reshape(d.shape[0], 1, -1)
    return (d * nearest_int(iscale * (x - lo)).clamp(0, 31) + m).reshape(weight.shape)


GRIDS = {
    "q2_k": (q2_k_grid, functools.partial(affine_apply, nmax=3)),
    "q3_k": (q3_k_grid, functools.partial(symmetric_apply, qmin=-4, qmax=3)),
    "q4_k": (q4_k_grid, functools.partial(affine_apply, nmax=15)),
    "q5_k": (q5_k_grid, functools.partial(affine_apply, nmax=31)),
    "q6_k": (q6_k_grid, functools.partial(symmetric_apply, qmin=-32, qmax=31)),
    "q4_0": (functools.partial(_symmetric_block_grid, nmax=8), functools.partial(coded_apply, nmax=8)),
    "q5_0": (functools.partial(_symmetric_block_grid, nmax=16), functools.partial(coded_apply, nmax=16)),
    "q5_1": (q5_1_grid, q5_1_apply),
}


def fake_quantize(weight: torch.Tensor, scheme: str, importance: torch.Tensor) -> torch.Tensor:
    """dequantize(quantize(weight)) as llama.cpp computes it with this importance per input column
    (`scheme` a key of GRIDS). [out, in] float32, [in] -> [out, in]"""
    grid, apply = GRIDS[scheme]
    w = weight.detach().float()
    return apply(w, grid(w, importance.float()))
