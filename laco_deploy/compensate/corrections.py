"""Lighter things to train than the surviving weights: a correction per pruned linear, merged
back under the mask once the layer is fitted, so the saved model has no extra modules.

- channel: one scale per output channel, W' = diag(s) W and b' = s * b. Zeros stay zeros.
- lowrank: a rank-r update restricted to the mask, W' = W + (B A) * M, B starting at zero.

Neither can reach a result that training the surviving weights cannot (both merge into a
matrix with the same mask); they exist to shrink gradients and AdamW state from out x in
values per matrix to out (channel) or r x (out + in) (lowrank).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class Corrections:
    """Trainable corrections on the pruned linears of one layer, applied with forward hooks."""

    def __init__(self, layer: torch.nn.Module, masks: dict[str, torch.Tensor], kind: str, rank: int, seed: int):
        if kind not in ("channel", "lowrank"):
            raise ValueError(f"unknown correction {kind!r}")
        self.layer, self.masks, self.kind = layer, masks, kind
        self.factors: dict[str, list[torch.nn.Parameter]] = {}
        self._hooks = []
        gen = torch.Generator().manual_seed(seed)
        for name in masks:
            lin = layer.get_submodule(name)
            w = lin.weight
            if kind == "channel":
                factors = [torch.nn.Parameter(torch.ones(w.shape[0], dtype=w.dtype, device=w.device))]
            else:
                # LoRA-style start: B = 0 so the layer is unchanged, A small and random
                a = torch.randn(rank, w.shape[1], generator=gen, dtype=w.dtype) / w.shape[1] ** 0.5
                factors = [torch.nn.Parameter(torch.zeros(w.shape[0], rank, dtype=w.dtype, device=w.device)),
                           torch.nn.Parameter(a.to(w.device))]
            self.factors[name] = factors
            self._hooks.append(lin.register_forward_hook(self._hook(name)))

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [p for fs in self.factors.values() for p in fs]

    def _delta(self, name: str) -> torch.Tensor:
        """lowrank: the masked update (B A) * M. [out, in]"""
        b, a = self.factors[name]
        return (b @ a) * self.masks[name]

    def _hook(self, name: str):
        def hook(module, args, out):
            if self.kind == "channel":
                return out * self.factors[name][0]
            return out + F.linear(args[0], self._delta(name).to(args[0].dtype))
        return hook

    @torch.no_grad()
    def merge(self) -> None:
        """Fold every correction into its linear (under the mask) and remove the hooks."""
        self.remove()
        for name, mask in self.masks.items():
            lin = self.layer.get_submodule(name)
            if self.kind == "channel":
                s = self.factors[name][0]
                lin.weight.mul_(s.unsqueeze(1))
                if lin.bias is not None:
                    lin.bias.mul_(s)
            else:
                lin.weight.add_(self._delta(name))
            lin.weight.masked_fill_(~mask, 0.0)  # +0.0 where pruned, whatever the arithmetic gave

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
