"""llama.cpp's k-quants below 4 bits, Q2_K and Q3_K, as pure tensor functions: weight -> dequantize(quantize(weight)).

The arithmetic follows ggml's reference quantizers (`quantize_row_q2_K_ref`, `quantize_row_q3_K_ref`
in ggml-quants.c, what `llama_model_quantize` runs when no importance matrix is given), vectorized
over all sub-blocks of a matrix with the sums in the C loops' order (kquants.py explains why).

- Q2_K: 16 sub-blocks of 16, x ~ d * sc_j * q - dmin * m_j with 2-bit q, 4-bit sc_j and m_j and fp16
  d, dmin per super-block of 256. Each sub-block's (scale, min) from `make_qkx2_quants` with nmax 3,
  weights |x|, 16 steps and the weighted absolute error (use_mad).
- Q3_K: 16 sub-blocks of 16, x ~ d * sc_j * q with 3-bit q in [-4, 3], 6-bit signed sc_j and fp16 d.
  Each sub-block's scale from `make_q3_quants`: the codes of -4 / peak, then up to 5 passes of
  coordinate descent that move one code at a time while the x^2-weighted fit improves.

Exactness against what llama.cpp writes: see tests/compensate/test_kquants_low.py and kquants.py.
Zeros: Q3_K is symmetric (a pruned weight stays 0); Q2_K is affine like Q4_K (a zero comes back as
a small offset, exactly as llama.cpp will run it).
"""

from __future__ import annotations

import functools

import torch

from laco_deploy.compensate.kquants import (QK_K, _EPS, _f32, _qkx2_scale_min, _seq_sum, affine_apply, fp16_round,
                                            nearest_int, symmetric_apply)


def q2_k_grid(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The Q2_K grid of a float32 matrix (rows a multiple of 256 long): per sub-block of 16 the step
    d * sc_j and the offset dmin * m_j, as float32. [out, in] -> ([blocks, 16, 1], [blocks, 16, 1])"""
    sub = weight.reshape(-1, 16).T.contiguous()  # [16, sub-blocks]
    scales, mins = _qkx2_scale_min(sub, sub.abs(), nmax=3, rmin=-0.5, rdelta=0.1, nstep=15, mad=True)
    scales, mins = scales.reshape(-1, QK_K // 16), mins.reshape(-1, QK_K // 16)  # [super-blocks, 16]
    max_scale = scales.amax(1, keepdim=True).clamp(min=0.0)
    max_min = mins.amax(1, keepdim=True).clamp(min=0.0)
    ls = torch.where(max_scale > 0, nearest_int(_f32(15.0) / max_scale * scales), 0.0).long()
    lm = torch.where(max_min > 0, nearest_int(_f32(15.0) / max_min * mins), 0.0).long()
    packed = (ls & 0xFF) | ((lm << 4) & 0xFF)  # the uint8 `scales[j]`: scale code low, min code high
    d = fp16_round(max_scale / 15.0) * (packed & 0xF)
    dm = fp16_round(max_min / 15.0) * (packed >> 4)
    return d.unsqueeze(-1), dm.unsqueeze(-1)


q2_k_apply = functools.partial(affine_apply, nmax=3)  # round onto a Q2_K grid (2-bit codes q, x ~ d * q - dm)


def q2_k(weight: torch.Tensor) -> torch.Tensor:
    """Q2_K round trip of a float32 matrix whose rows are a multiple of 256 long. [out, in] -> [out, in]"""
    return q2_k_apply(weight, q2_k_grid(weight))


def descend(x: torch.Tensor, w: torch.Tensor, codes: torch.Tensor, sumlx: torch.Tensor, suml2: torch.Tensor, *,
            qmin: int | None, qmax: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ggml's coordinate descent on the codes of each column (up to 5 passes; `make_q3_quants`: qmin
    -nmax, `make_qp_quants`: qmin None, its uint8 codes, where a move also needs sl2 > 0 before it):
    move one code at a time to nearest_int(x * sl2 / slx) while the weighted fit sumlx^2 / suml2 grows.
    x, w, codes [k, n], sums [n] -> (codes, sumlx, suml2)"""
    for _ in range(5):
        changed = False
        for i in range(x.shape[0]):  # one code at a time, each move seeing the sums the previous left
            xi, wi, li = x[i], w[i], codes[i]
            slx = sumlx - wi * xi * li
            sl2 = suml2 - wi * li * li
            ok = (slx > 0) if qmin is not None else (slx > 0) & (sl2 > 0)
            new = nearest_int(xi * sl2 / torch.where(ok, slx, torch.ones_like(slx))).clamp(qmin, qmax)
            slx = slx + wi * xi * new
            sl2 = sl2 + wi * new * new
            take = ok & (new != li) & (sl2 > 0) & (slx * slx * suml2 > sumlx * sumlx * sl2)
            codes[i] = torch.where(take, new if qmin is not None else torch.where(new < 0, new + 256, new), li)
            sumlx, suml2 = torch.where(take, slx, sumlx), torch.where(take, sl2, suml2)
            changed = changed or bool(take.any())
        if not changed:  # a pass that moves nothing leaves every later pass nothing to move
            break
    return codes, sumlx, suml2


def _q3_scale(x: torch.Tensor, nmax: int = 4) -> torch.Tensor:
    """`make_q3_quants(n, nmax, x, L, do_rmse=true)` on each column (one sub-block of k values). x [k, n] -> [1, n]"""
    peak = x.gather(0, x.abs().argmax(0, keepdim=True))  # the signed value of largest magnitude (first on ties)
    empty = peak.abs() < _EPS
    iscale = _f32(-nmax) / torch.where(empty, torch.ones_like(peak), peak)
    codes = nearest_int(iscale * x).clamp(-nmax, nmax - 1)  # [k, n]
    w = x * x
    sumlx, suml2 = _seq_sum(w * x * codes)[0], _seq_sum(w * codes * codes)[0]
    codes, sumlx, suml2 = descend(x, w, codes, sumlx, suml2, qmin=-nmax, qmax=nmax - 1)
    scale = torch.where(suml2 > 0, sumlx / torch.where(suml2 > 0, suml2, torch.ones_like(suml2)), torch.zeros_like(sumlx))
    return torch.where(empty[0], torch.zeros_like(scale), scale).unsqueeze(0)


def q3_k_grid(weight: torch.Tensor) -> torch.Tensor:
    """The Q3_K grid of a float32 matrix (rows a multiple of 256 long): the step d * sc_j of each
    sub-block of 16, float32. [out, in] -> [blocks, 16, 1]"""
    scales = _q3_scale(weight.reshape(-1, 16).T.contiguous()).reshape(-1, QK_K // 16)  # [super-blocks, 16]
    peak = scales.gather(1, scales.abs().argmax(1, keepdim=True))
    empty = peak == 0
    iscale = _f32(-32.0) / torch.where(empty, torch.ones_like(peak), peak)
    sc = nearest_int(iscale * scales).clamp(-32, 31)
    d = fp16_round(_f32(1.0) / iscale) * sc
    return torch.where(empty, torch.zeros_like(d), d).unsqueeze(-1)


q3_k_apply = functools.partial(symmetric_apply, qmin=-4, qmax=3)  # round onto a Q3_K grid (codes q in [-4, 3])


def q3_k(weight: torch.Tensor) -> torch.Tensor:
    """Q3_K round trip of a float32 matrix whose rows are a multiple of 256 long. [out, in] -> [out, in]"""
    return q3_k_apply(weight, q3_k_grid(weight))
