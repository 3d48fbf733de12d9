"""One interface to get next-token logits from a model on any runtime.

Fidelity and perplexity code is written once against `CausalRunner`; the PyTorch, onnxruntime
and llama.cpp backends implement it. `open_runner` picks the backend from the candidate path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

from laco_deploy.errors import ModelError
from laco_deploy.targets import target_for_path


class CausalRunner(Protocol):
    name: str  # "pytorch" or a target's runtime (targets.py)

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Next-token logits for one sequence. input_ids [seq] int64 -> [seq, vocab] float32 on CPU."""
        ...


class TorchRunner:
    name = "pytorch"

    def __init__(self, model, device: torch.device | str = "cpu"):
        self.model = model.to(device).eval()
        self.device = torch.device(device)

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids.view(1, -1).to(self.device), use_cache=False)
        return out.logits[0].float().cpu()


def open_runner(path: str | Path, device: torch.device | str = "cpu", threads: int | None = None,
                max_tokens: int | None = None) -> CausalRunner:
    """A runner for a candidate: an export of a target in targets.py (a .gguf file, an .onnx file or
    ONNX export folder) on that target's runtime, or a Hugging Face directory (PyTorch)."""
    p = Path(path)
    if not p.exists():
        raise ModelError(f"candidate {path} not found; pass a Hugging Face directory, an .onnx file/folder or a .gguf file")
    target = target_for_path(p)
    if target is not None:
        return target.open_runner(p, device=device, threads=threads, max_tokens=max_tokens)
    from laco_deploy.models import load_model

    return TorchRunner(load_model(str(p)).model, device)
