"""The final KL pass's optimizer state between a layer's steps: in memory, or with --offload disk in
one file per decoder layer, so the pass holds one layer's state at a time (issue 33).

AdamW holds two fp32 moments per weight: 810 MiB for SmolLM2-135M, about 56 GB at 7B, more than
the model itself; a model streamed from disk because it does not fit in RAM cannot keep them there.

Tried and dropped: storing only the moments of kept weights (those of pruned weights stay exactly
zero). It was bit-identical and halved the stored state (810 -> 405 MiB on SmolLM2-135M), but the
gathers and scatters doubled the pass's time and the allocation churn raised the stage's peak RSS
from 2,078 to 2,418 MiB (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from laco_deploy.memory import trim_heap


class LayerStates:
    """Per decoder layer: {parameter name: optimizer state} between that layer's steps.
    `folder`: None keeps them in memory as they are; a folder (the pass's own, emptied first) keeps
    them on disk."""

    def __init__(self, folder: Path | None):
        self.folder = folder
        self._memory: dict[int, dict[str, dict]] = {}
        self._bytes: dict[int, int] = {}
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)  # a killed earlier pass's state is stale
            folder.mkdir(parents=True)

    def put(self, index: int, states: dict[str, dict]) -> None:
        """Store layer `index`'s states ({parameter name: the optimizer's state dict})."""
        self._bytes[index] = sum(v.numel() * v.element_size() for state in states.values() for v in state.values()
                                 if isinstance(v, torch.Tensor))
        if self.folder is None:
            self._memory[index] = states
            return
        flat = {f"{name}/{key}": v.cpu() if isinstance(v, torch.Tensor) else v
                for name, state in states.items() for key, v in state.items()}
        path = self.folder / f"layer-{index}.pt"
        part = path.with_suffix(".partial")
        torch.save(flat, part)
        part.replace(path)
        del flat, states
        trim_heap()  # the layer's state was just freed: give its pages back before the next layer's load

    def get(self, index: int, device: torch.device) -> dict[str, dict]:
        """Layer `index`'s states as put (on `device`); {} before its first step."""
        if self.folder is None:
            return self._memory.pop(index, {})
        path = self.folder / f"layer-{index}.pt"
        if not path.is_file():
            return {}
        states: dict[str, dict] = {}
        for full_key, value in torch.load(path, map_location=device, weights_only=True).items():
            name, key = full_key.split("/", 1)
            states.setdefault(name, {})[key] = value
        return states

    def nbytes(self) -> int:
        """Bytes of state stored (memory or disk), as last put."""
        return sum(self._bytes.values())

    def close(self) -> None:
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
