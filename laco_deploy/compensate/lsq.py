"""Closed-form LaCo initialisation: a masked ridge least-squares refit of each pruned linear.

For every prunable linear of a layer, in the order the layer calls them, the surviving weights
are refit so that, fed the sparse path's inputs (outputs of the already compensated layers),
the linear reproduces what the dense linear outputs on the dense path:

    min_W  sum_tokens || W x_sparse - W_dense x_dense ||^2 + damp * || W - W_pruned ||^2,  W = 0 off the mask

Row i with surviving inputs S has the solution w_S = (G_SS + damp I)^-1 (C_S,i + damp w_pruned,S)
with G = sum x x^T and C = sum x y^T. Linears that share an input (q/k/v, gate/up) are solved
together, then the layer is re-run so the next group sees the refit inputs (true-sequential).

Structured (width-pruned) layers: a linear whose output rows were removed (q/k/v without their
head groups, gate/up without their FFN channels) has no dense output to match row for row, so it
keeps its pruned weights; down_proj and o_proj, which write the full hidden width, are refit from
the smaller layer's activations: a closed-form warm start that restores what the removed channels
and heads contributed (on average and in the directions calibration excites) before training.

Why it transfers: the update of each row lies in the span of the calibration inputs, so on an
input orthogonal to everything seen in calibration the refit linear behaves exactly like the
pruned one; an Adam-trained layer moves in every direction. The ridge term keeps directions that
calibration barely excites close to the pruned weights.
"""

from __future__ import annotations

import torch

from laco_deploy import distributed, families
from laco_deploy.engine.walk import LayerContext

SYSTEM_BYTES = 256 * 2**20  # memory for one chunk of per-row systems [rows, k, k]
# The damped systems are well conditioned (ridge >= 1% of the mean input energy), so fp32 solves
# suffice and take half the time of fp64; the statistics are summed in fp64.
SOLVE_DTYPE = torch.float32

# Linears whose output is added to the residual stream, and where that stream comes from: the
# layer's input (attention block) or the input of the named norm (MLP block); per family
# (families.Family.residual_writers; Gemma normalises those outputs first, so it has none). Their
# target also absorbs the difference between the dense and the sparse residual stream, so the
# layer's output (not only each linear's) moves towards the dense hidden states: LaCo's objective,
# in closed form.


class _Enough(Exception):
    """Raised by a hook once everything asked for was caught: the rest of the layer need not run."""


def _run_until(ctx: LayerContext, layer: torch.nn.Module, hidden: torch.Tensor, inputs: list[str],
               outputs: list[str]) -> dict[str, torch.Tensor]:
    """Run `layer` on `hidden` only as far as needed to catch the inputs of the modules named in
    `inputs` and the outputs of those in `outputs`; returns name -> tensor (inputs keyed "in:NAME")."""
    caught: dict[str, torch.Tensor] = {}
    wanted = len(inputs) + len(outputs)

    def keep(key: str, value: torch.Tensor) -> None:
        caught[key] = value
        if len(caught) == wanted:
            raise _Enough

    handles = [layer.get_submodule(n).register_forward_pre_hook(lambda _m, args, n=n: keep("in:" + n, args[0]))
               for n in inputs]
    handles += [layer.get_submodule(n).register_forward_hook(lambda _m, _a, out, n=n: keep(n, out)) for n in outputs]
    try:
        ctx.forward(layer, hidden)
    except _Enough:
        pass
    finally:
        for h in handles:
            h.remove()
    return caught


@torch.no_grad()
def linear_groups(ctx: LayerContext, names: list[str]) -> list[list[str]]:
    """The layer's linears grouped by shared input, in call order (q/k/v, o, gate/up, down for Llama)."""
    # the inputs themselves are kept until grouped: a freed input's memory can be reused by a later
    # one (e.g. the post-attention norm's output at the address of the input norm's), which
    # would merge gate/up into the q/k/v group, and differently in each process
    seen: list[tuple[torch.Tensor, str]] = []
    handles = [ctx.layer.get_submodule(n).register_forward_pre_hook(
        lambda _m, args, n=n: seen.append((args[0], n))) for n in names]
    try:
        ctx.forward(ctx.layer, ctx.inputs.batch(0, 1, ctx.device))
    finally:
        for h in handles:
            h.remove()
    groups: dict[int, list[str]] = {}
    for x, name in seen:
        if name not in groups.setdefault(x.data_ptr(), []):
            groups[x.data_ptr()].append(name)
    return list(groups.values())


def _residual_norms(layer: torch.nn.Module, group: list[str]) -> list[str]:
    """Norm modules whose input is the residual stream some linear of `group` writes to."""
    writers = families.of_layer(layer).residual_writers
    return [writers[n] for n in group if writers.get(n) and hasattr(layer, writers[n])]


def _targets(layer: torch.nn.Module, group: list[str], yout: dict, res_s: dict, res_d: dict, h_s: torch.Tensor,
             h_d: torch.Tensor) -> dict:
    """Each linear's target: the dense linear's output, plus the dense-minus-sparse residual stream
    for the linears that write to it. [b, s, out] each."""
    writers = families.of_layer(layer).residual_writers
    out = {}
    for n in group:
        y = yout[n]
        if n in writers:
            src = writers[n]
            y = y + ((h_d - h_s) if src is None else (res_d[src] - res_s[src]))
        out[n] = y
    return out


@torch.no_grad()
def _statistics(ctx: LayerContext, group: list[str], idx: torch.Tensor, token_weight: str,
                shard: distributed.Shard | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """G = sum x x^T over the group's sparse-path input, and C[name] = sum x y^T against each
    linear's target (see _targets); a bias column of ones is appended to x. fp64 sums.
    `idx` are global sample indices; in a torchrun job each rank sums those of its `shard` and
    the sums are added over ranks."""
    gram, cross = None, {n: None for n in group}
    norms = _residual_norms(ctx.layer, group)
    rows = shard.local(idx) if shard is not None else idx
    for chunk in rows.split(ctx.batch_size) if len(rows) else ():  # split() of nothing gives one empty chunk
        h_s, h_d = ctx.inputs.data[chunk].to(ctx.device), ctx.dense_inputs.data[chunk].to(ctx.device)
        sparse = _run_until(ctx, ctx.layer, h_s, group[:1] + norms, [])
        dense = _run_until(ctx, ctx.dense_layer, h_d, norms, group)
        res_s = {n: sparse["in:" + n] for n in norms}
        res_d = {n: dense["in:" + n] for n in norms}
        yout = _targets(ctx.layer, group, {n: dense[n] for n in group}, res_s, res_d, h_s, h_d)
        x = sparse["in:" + group[0]].reshape(-1, sparse["in:" + group[0]].shape[-1]).float()  # [tokens, in]
        x = torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype, device=x.device)], 1)
        # weight each token by 1 / ||dense layer output||^2, as the nmse loss does, so a few
        # high-norm tokens (attention sinks) do not dominate the fit
        weight = torch.ones(x.shape[0], dtype=x.dtype, device=x.device)
        if token_weight == "nmse":
            dense_out = ctx.dense_targets.data[chunk].reshape(x.shape[0], -1).to(ctx.device)
            weight = 1.0 / dense_out.pow(2).mean(1).clamp_min(1e-12).float()  # [tokens]
        # per-chunk products in fp32 (fast), summed over chunks in fp64 (no drift over many tokens)
        g = (x.T @ (x * weight[:, None])).double()
        gram = g if gram is None else gram + g
        for n in group:
            c = (x.T @ (yout[n].reshape(-1, yout[n].shape[-1]).float() * weight[:, None])).double()  # [in + 1, out]
            cross[n] = c if cross[n] is None else cross[n] + c
    if distributed.world() > 1:
        gram, cross = _sum_over_ranks(ctx, group, gram, cross)
    return gram, cross


def _sum_over_ranks(ctx: LayerContext, group: list[str], gram, cross) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Add the statistics of every rank (zeros from a rank that held none of the samples)."""
    lin0 = ctx.layer.get_submodule(group[0])
    size = lin0.in_features + 1
    if gram is None:
        gram = torch.zeros(size, size, dtype=torch.float64, device=ctx.device)
    distributed.all_reduce_(gram)
    for n in group:
        if cross[n] is None:
            cross[n] = torch.zeros(size, ctx.layer.get_submodule(n).out_features, dtype=torch.float64, device=ctx.device)
        distributed.all_reduce_(cross[n])
    return gram, cross


def _spd_solve(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Solve a x = b for a batch of symmetric positive definite systems. a [r, k, k], b [r, k]."""
    chol, info = torch.linalg.cholesky_ex(a)
    if bool((info == 0).all()):
        return torch.cholesky_solve(b.unsqueeze(-1), chol).squeeze(-1)
    return torch.linalg.solve(a, b.unsqueeze(-1)).squeeze(-1)  # numerically indefinite: LU is slower but safe


def _solve_rows(gram: torch.Tensor, cross: torch.Tensor, w0: torch.Tensor, mask: torch.Tensor,
                damp: float) -> torch.Tensor:
    """Masked ridge solution row by row. gram [k, k], cross [k, out], w0/mask [out, k] -> W [out, k].

    When every row keeps the same number of inputs (per-row unstructured, N:M, structured), each
    row's system is gathered down to its surviving inputs; otherwise the dropped inputs get an
    identity block, which makes their solution exactly 0. Rows go in chunks to bound memory."""
    lam = damp * float(gram.diagonal().mean())
    gram, cross = gram.to(SOLVE_DTYPE), cross.to(SOLVE_DTYPE)
    out = torch.zeros(w0.shape, dtype=SOLVE_DTYPE, device=w0.device)
    counts = mask.sum(1)
    kept = int(counts[0])
    same = bool((counts == kept).all())
    size = kept if same else gram.shape[0]
    rows = max(1, min(w0.shape[0], SYSTEM_BYTES // (gram.element_size() * size * size)))
    for start in range(0, w0.shape[0], rows):
        m, w = mask[start:start + rows], w0[start:start + rows].to(SOLVE_DTYPE)
        c = cross[:, start:start + rows].T  # [r, k]
        if same:
            idx = m.nonzero()[:, 1].view(m.shape[0], kept)  # surviving input indices per row, sorted
            a = gram[idx[:, :, None], idx[:, None, :]] + lam * torch.eye(kept, dtype=gram.dtype, device=gram.device)
            x = _spd_solve(a, c.gather(1, idx) + lam * w.gather(1, idx))
            out[start:start + rows].scatter_(1, idx, x)
        else:
            mf = m.to(gram.dtype)
            eye = torch.eye(size, dtype=gram.dtype, device=gram.device)
            a = gram * (mf[:, :, None] * mf[:, None, :]) + eye * (lam * mf[:, None, :] + (1 - mf[:, None, :]))
            out[start:start + rows] = _spd_solve(a, (c + lam * w) * mf) * mf
    return out


def supervised(ctx: LayerContext, names: list[str]) -> list[str]:
    """The linears whose output is as wide as the dense twin's, so the dense output is their target
    (all of them, unless structured pruning removed output rows)."""
    return [n for n in names
            if ctx.layer.get_submodule(n).out_features == ctx.dense_layer.get_submodule(n).out_features]


@torch.no_grad()
def refit_layer(ctx: LayerContext, masks: dict[str, torch.Tensor], idx: torch.Tensor, damp: float,
                token_weight: str = "none", shard: distributed.Shard | None = None) -> None:
    """Refit the surviving weights (and biases) of the layer's masked linears in place, group by group,
    on the calibration samples `idx`. The masks are kept: dropped weights stay +0.0."""
    for group in linear_groups(ctx, supervised(ctx, list(masks))):
        gram, cross = _statistics(ctx, group, idx, token_weight, shard)
        for name in group:
            lin = ctx.layer.get_submodule(name)
            w0 = lin.weight.detach()
            bias0 = lin.bias.detach() if lin.bias is not None else torch.zeros(w0.shape[0], device=w0.device)
            full_w0 = torch.cat([w0, bias0[:, None]], 1)
            has_bias = torch.full((w0.shape[0], 1), lin.bias is not None, dtype=torch.bool, device=w0.device)
            full_mask = torch.cat([masks[name].to(w0.device), has_bias], 1)
            w = _solve_rows(gram, cross[name], full_w0, full_mask, damp)
            lin.weight.copy_(w[:, :-1].to(w0.dtype))
            lin.weight.masked_fill_(~masks[name].to(w0.device), 0.0)  # +0.0 exactly, never -0.0
            if lin.bias is not None:
                lin.bias.copy_(w[:, -1].to(w0.dtype))
