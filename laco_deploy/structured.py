"""Per-layer widths of structured-pruned models (smaller FFN / fewer heads in some layers).

transformers' Llama assumes one width for all layers, so a structured-pruned directory records
its widths in config.json under `laco_layer_widths` and is rebuilt here: build the model at full
size, shrink each layer's linears to the recorded shapes, then load the safetensors.
Owned by the pruning stage (issue 3); the loader calls these two functions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def has_layer_widths(config: Any) -> bool:
    return bool(getattr(config, "laco_layer_widths", None))


def load_structured(path: Path, config: Any):
    raise NotImplementedError("structured-pruned model loading is implemented by the pruning stage")
