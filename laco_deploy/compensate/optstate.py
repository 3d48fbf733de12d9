"""The final KL pass's optimizer state between a layer's steps: only the entries the mask keeps,
in memory or, with --offload disk, in one file per decoder layer (issue 33).

AdamW holds two fp32 moments per weight: 810 MiB for SmolLM2-135M, about 56 GB at 7B, more than
the model itself. A pruned weight's gradient is masked to zero, so its moments stay exactly zero:
keeping only the kept entries halves the state at 50% sparsity and changes no bit of the result
(tests/compensate/test_optstate.py). On disk the pass holds one layer's state at a time.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

_KEPT = "@kept"  # suffix of a state entry stored as its kept entries only (1-D)


class LayerStates:
    """Per decoder layer: {parameter name: optimizer state} between that layer's steps.
    `folder`: None keeps them in memory; a folder (this pass's own, emptied first) keeps them on disk."""

    def __init__(self, folder: Path | None):
        self.folder = folder
        self._memory: dict[int, dict[str, torch.Tensor]] = {}
        self._bytes: dict[int, int] = {}
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)  # a killed earlier pass's state is stale
            folder.mkdir(parents=True)

    def put(self, index: int, states: dict[str, dict], keep: dict[str, torch.Tensor | None]) -> None:
        """Store layer `index`'s states; keep[name]: the weight's bool mask (None: every entry kept)."""
        flat: dict[str, torch.Tensor] = {}
        for name, state in states.items():
            mask = keep.get(name)
            for key, value in state.items():
                if mask is not None and isinstance(value, torch.Tensor) and value.shape == mask.shape:
                    flat[f"{name}/{key}{_KEPT}"] = value[mask.to(value.device)]
                else:
                    flat[f"{name}/{key}"] = value
        self._bytes[index] = sum(v.numel() * v.element_size() for v in flat.values() if isinstance(v, torch.Tensor))
        if self.folder is None:
            self._memory[index] = flat
            return
        path = self.folder / f"layer-{index}.pt"
        part = path.with_suffix(".partial")
        torch.save({k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in flat.items()}, part)
        part.replace(path)

    def get(self, index: int, keep: dict[str, torch.Tensor | None], device: torch.device) -> dict[str, dict]:
        """Layer `index`'s states as the optimizer holds them (full-size tensors on `device`); {} before
        its first step."""
        if self.folder is None:
            flat = self._memory.pop(index, {})
        else:
            path = self.folder / f"layer-{index}.pt"
            flat = torch.load(path, map_location=device, weights_only=True) if path.is_file() else {}
        states: dict[str, dict] = {}
        for full_key, value in flat.items():
            name, key = full_key.split("/", 1)
            if key.endswith(_KEPT):
                mask = keep[name].to(value.device)
                dense = torch.zeros(mask.shape, dtype=value.dtype, device=value.device)
                dense[mask] = value
                key, value = key[: -len(_KEPT)], dense
            states.setdefault(name, {})[key] = value
        return states

    def nbytes(self) -> int:
        """Bytes of state stored (memory or disk), as last put."""
        return sum(self._bytes.values())

    def close(self) -> None:
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
