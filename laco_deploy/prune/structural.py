"""Structured pruning: remove FFN channels and whole KV head groups physically from a decoder layer.

An FFN channel j is row j of gate_proj and up_proj and column j of down_proj (rows j and ffn + j of
Phi-3's fused gate_up_proj, so both halves keep the same channels). A head group g is
KV head g (rows of k_proj, v_proj) with the G = heads / kv_heads query heads that share it (rows of
q_proj, columns of o_proj); removing whole groups keeps the GQA ratio, head_dim and RoPE intact.
The smaller widths are recorded in config.json (laco_deploy.structured.write_widths): in transformers'
own keys when every layer has the same (plain `from_pretrained` loads the folder), per layer otherwise.

Importance (from the calibration inputs of the layer, on the sparse path):
- "wanda": sum of Wanda scores |W| ||X|| over all weights of the channel / group;
- "fluctuation" (FLAP): Var(X_j) ||W[:, j]||^2 of the input columns of down_proj / o_proj.
"""

from __future__ import annotations

import logging
import time

import torch

from laco_deploy import families
from laco_deploy.errors import ConfigError
from laco_deploy.prune import scoring
from laco_deploy.prune.stats import InputStats, collect_input_stats
from laco_deploy.prune.step import matrix_record

log = logging.getLogger(__name__)
FFN = ("gate_proj", "up_proj", "down_proj")
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


def removal_count(width: int, ratio: float, multiple: int = 1) -> int:
    """Channels (or head groups) removed from `width` at `ratio`, rounded to nearest so that the
    number kept is a multiple of `multiple` (quantization blocks run along a kept-channel row), at
    least one multiple; a width narrower than one multiple keeps the exact count."""
    removed = int(width * ratio + 0.5)
    if multiple > 1 and width >= multiple:
        kept = max(1, int((width - removed) / multiple + 0.5)) * multiple
        return width - min(kept, width)
    return removed


def _parts(targets: tuple[str, ...], family: families.Family) -> tuple[bool, bool]:
    """(prune FFN channels, prune head groups) from the target linears and what the family allows."""
    return any(t in targets for t in FFN), family.structured_heads and any(t in targets for t in ATTN)


def check_feasible(config, targets: tuple[str, ...], ratio: float, multiple: int) -> None:
    """Refuse a ratio (prune.structured) that would remove every FFN channel or every head group of a
    layer, or leave less than one block of `multiple` (prune.structured_multiple) channels, and head
    groups where the family cannot lose them per layer (then only FFN channels go, said in the log)."""
    from laco_deploy.structured import layer_widths

    family = families.of_config(config) or families.TABLE[0]
    ffn_on, attn_on = _parts(targets, family)
    if not family.structured_heads and any(t in targets for t in ATTN):
        why = (f"{family.label} splits its fused {family.attention[0]} by the model-wide head count, so head groups "
               "cannot be removed per layer")
        if not ffn_on:
            raise ConfigError(f"prune.structured on attention only: {why}; target the MLP "
                              f"({','.join(FFN)}) or prune attention unstructured")
        log.warning("prune.structured: %s; removing FFN channels only", why)
    for i, w in enumerate(layer_widths(config)):
        ffn = w["intermediate_size"]
        if ffn_on and removal_count(ffn, ratio, multiple) >= ffn:
            raise ConfigError(f"prune.structured {ratio} would remove all {ffn} FFN channels "
                              f"of layer {i}; use a smaller ratio")
        kv = w["num_key_value_heads"]
        if attn_on and removal_count(kv, ratio) >= kv:
            raise ConfigError(f"prune.structured {ratio} would remove all {kv} attention head groups of layer {i}; "
                              f"use a ratio below {(kv - 0.5) / kv:.2f}, or prune.targets gate_proj,up_proj,down_proj for FFN only")
        if ffn_on and multiple > 1 and ffn >= multiple and int((ffn - int(ffn * ratio + 0.5)) / multiple + 0.5) < 1:
            kept = ffn - removal_count(ffn, ratio, multiple)  # one block: the fewest a layer keeps
            raise ConfigError(f"prune.structured {ratio} would leave layer {i} less than one block of "
                              f"prune.structured_multiple {multiple} FFN channels, so it would keep {kept} of {ffn} "
                              f"({1 - kept / ffn:.0%} removed, not {ratio:.0%}); use a ratio up to "
                              f"{(ffn - multiple) / ffn:.2f}, or prune.structured_multiple 1 for the exact ratio")


def _gate_up(mlp) -> tuple[torch.Tensor, torch.Tensor]:
    """gate and up weights [ffn, hidden] each; views into Phi-3's fused gate_up_proj ([gate; up] rows)."""
    if hasattr(mlp, "gate_up_proj"):
        w = mlp.gate_up_proj.weight
        return w[: w.shape[0] // 2], w[w.shape[0] // 2:]
    return mlp.gate_proj.weight, mlp.up_proj.weight


def ffn_importance(mlp, stats: dict[str, InputStats], metric: str) -> torch.Tensor:
    """Importance of each intermediate channel. stats by module short name. -> [ffn]"""
    down = mlp.down_proj.weight
    if metric == "fluctuation":
        return scoring.fluctuation_importance(down, stats["down_proj"].variance())
    x_in = stats["gate_up_proj" if hasattr(mlp, "gate_up_proj") else "gate_proj"].sq_sum
    gate, up = _gate_up(mlp)
    return (scoring.wanda_row_importance(gate, x_in) + scoring.wanda_row_importance(up, x_in)
            + scoring.wanda_column_importance(down, stats["down_proj"].sq_sum))


def head_group_importance(attn, stats: dict[str, InputStats], metric: str, kv_heads: int) -> torch.Tensor:
    """Importance of each KV head group (KV head + its query heads). -> [kv_heads]"""
    o = attn.o_proj.weight
    if metric == "fluctuation":
        return scoring.group_sum(scoring.fluctuation_importance(o, stats["o_proj"].variance()), kv_heads)
    x_in = stats["q_proj"].sq_sum
    score = scoring.group_sum(scoring.wanda_column_importance(o, stats["o_proj"].sq_sum), kv_heads)
    score += scoring.group_sum(scoring.wanda_row_importance(attn.q_proj.weight, x_in), kv_heads)
    for lin in (attn.k_proj, attn.v_proj):
        score += scoring.group_sum(scoring.wanda_row_importance(lin.weight, x_in), kv_heads)
    return score


def _slice_linear(lin: torch.nn.Linear, rows: torch.Tensor | None = None, cols: torch.Tensor | None = None) -> torch.nn.Linear:
    """A new Linear holding the kept rows (outputs) and/or columns (inputs) of `lin`."""
    w = lin.weight.data
    b = lin.bias.data if lin.bias is not None else None
    if rows is not None:
        w = w.index_select(0, rows.to(w.device))
        b = b.index_select(0, rows.to(w.device)) if b is not None else None
    if cols is not None:
        w = w.index_select(1, cols.to(w.device))
    new = torch.nn.Linear(w.shape[1], w.shape[0], bias=b is not None, device=w.device, dtype=w.dtype)
    new.weight.data.copy_(w)
    if b is not None:
        new.bias.data.copy_(b)
    new.weight.requires_grad_(lin.weight.requires_grad)
    return new


def remove_ffn_channels(mlp, keep: torch.Tensor) -> None:
    """Keep intermediate channels `keep` [k] (ascending): rows of gate/up, columns of down. A fused
    gate_up_proj keeps the same channels in both halves, so it stays [gate; up]."""
    if hasattr(mlp, "gate_up_proj"):
        half = mlp.gate_up_proj.out_features // 2
        mlp.gate_up_proj = _slice_linear(mlp.gate_up_proj, rows=torch.cat([keep, keep + half]))
    else:
        mlp.gate_proj = _slice_linear(mlp.gate_proj, rows=keep)
        mlp.up_proj = _slice_linear(mlp.up_proj, rows=keep)
    mlp.down_proj = _slice_linear(mlp.down_proj, cols=keep)
    if hasattr(mlp, "intermediate_size"):
        mlp.intermediate_size = int(keep.numel())


def head_rows(groups: torch.Tensor, per_group: int, head_dim: int) -> torch.Tensor:
    """Row indices of the heads of `groups` when each group holds `per_group` heads of `head_dim` rows."""
    span = per_group * head_dim
    return (groups.unsqueeze(1) * span + torch.arange(span, device=groups.device).unsqueeze(0)).flatten()


def remove_head_groups(attn, keep_groups: torch.Tensor, kv_heads: int) -> None:
    """Keep KV head groups `keep_groups` [k] (ascending): q/k/v rows and o columns of those heads."""
    head_dim = attn.head_dim
    group = attn.q_proj.out_features // head_dim // kv_heads  # query heads per KV head
    q_idx = head_rows(keep_groups, group, head_dim)
    kv_idx = head_rows(keep_groups, 1, head_dim)
    attn.q_proj = _slice_linear(attn.q_proj, rows=q_idx)
    attn.k_proj = _slice_linear(attn.k_proj, rows=kv_idx)
    attn.v_proj = _slice_linear(attn.v_proj, rows=kv_idx)
    attn.o_proj = _slice_linear(attn.o_proj, cols=q_idx)


def layer_width(layer) -> dict[str, int]:
    """Current widths of a decoder layer, read from its module shapes (fused qkv: [q; k; v] rows)."""
    attn, head_dim = layer.self_attn, layer.self_attn.head_dim
    q_rows = attn.o_proj.in_features
    kv_rows = attn.k_proj.out_features if hasattr(attn, "k_proj") else (attn.qkv_proj.out_features - q_rows) // 2
    return {"intermediate_size": layer.mlp.down_proj.in_features,
            "num_attention_heads": q_rows // head_dim, "num_key_value_heads": kv_rows // head_dim}


def prune_layer_structured(ctx, targets: tuple[str, ...], ratio: float, multiple: int, metric: str) -> dict:
    """Shrink `ctx.layer` (engine LayerContext) by `ratio` (prune.structured; FFN channels in blocks of
    `multiple`, scored by `metric`); return widths, kept indices, matrices."""
    t0 = time.perf_counter()
    layer = ctx.layer
    family = families.of_layer(layer)
    ffn_on, attn_on = _parts(targets, family)
    before = layer_width(layer)
    names = ({f"mlp.{n}": getattr(layer.mlp, n) for n in family.ffn}
             | {f"self_attn.{n}": getattr(layer.self_attn, n) for n in family.attention})
    ctx.progress("statistics")
    raw = collect_input_stats(ctx, names, hessian=False)
    stats = {k.rsplit(".", 1)[-1]: v for k, v in raw.items()}
    rec: dict = {"layer": ctx.index, "ratio": ratio}
    with torch.no_grad():
        if ffn_on:
            ctx.progress("ffn channels")
            scores = ffn_importance(layer.mlp, stats, metric)
            keep = scoring.keep_indices(scores, removal_count(before["intermediate_size"], ratio, multiple))
            remove_ffn_channels(layer.mlp, keep)
            rec["kept_ffn_channels"] = keep.tolist()
        if attn_on:
            ctx.progress("head groups")
            kv = before["num_key_value_heads"]
            scores = head_group_importance(layer.self_attn, stats, metric, kv)
            keep_g = scoring.keep_indices(scores, removal_count(kv, ratio))
            remove_head_groups(layer.self_attn, keep_g, kv)
            rec["kept_head_groups"] = keep_g.tolist()
    rec["widths"] = layer_width(layer)
    rec["seconds"] = round(time.perf_counter() - t0, 3)
    shrunk = ([f"mlp.{n}" for n in family.ffn] if ffn_on else []) + ([f"self_attn.{n}" for n in family.attention] if attn_on else [])
    rec["matrices"] = {f"model.layers.{ctx.index}.{n}": matrix_record(layer.get_submodule(n).weight.data) for n in shrunk}
    return rec


def record_widths(config, records: list[dict]) -> None:
    """Write the per-layer widths into the HF config (laco_deploy.structured.write_widths)."""
    from laco_deploy.structured import write_widths

    write_widths(config, [r["widths"] for r in records])
