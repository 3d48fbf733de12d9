"""Per-layer checkpoints of a layer walk, so a killed run resumes where it stopped.

After each layer the walk saves the layer's weights (safetensors) and the step's record (JSON).
A resumed walk restores finished layers instead of running their step again; `meta.json` holds
the settings fingerprint, and checkpoints made with other settings are refused.

In a torchrun job rank 0 owns the folder (checks, clears and writes it); whether a layer is
restored is rank 0's decision on every rank, since a rank that restored while another trained
would wait forever in the other's collectives. All ranks read the restored files, so a
multi-node resume needs the folder on a shared file system.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from laco_deploy import distributed
from laco_deploy.errors import ConfigError
from laco_deploy.fsutil import atomic_path, write_json

log = logging.getLogger(__name__)


class LayerCheckpoints:
    """The checkpoint folder of one walk. `resume=False` clears old layers; `resume=True` reuses them."""

    def __init__(self, directory: Path, fingerprint: dict, resume: bool = False):
        self.directory = Path(directory)
        self.fingerprint = json.loads(json.dumps(fingerprint, default=str))  # tuples -> lists, as read back
        self.resume = resume

    def _files(self, i: int) -> tuple[Path, Path]:
        return self.directory / f"layer_{i:03d}.safetensors", self.directory / f"layer_{i:03d}.json"

    def prepare(self) -> None:
        """Check the fingerprint of existing checkpoints (resume) or start a clean folder."""
        if not distributed.is_main():
            return
        meta = self.directory / "meta.json"
        if self.resume and meta.is_file():
            if json.loads(meta.read_text()) != self.fingerprint:
                raise ConfigError(
                    f"the checkpoints in {self.directory} were made with other settings; "
                    "rerun with the same settings, or start over without resuming"
                )
            return
        if self.resume:
            log.warning("no checkpoints to resume from in %s; starting from the first layer", self.directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        for old_file in list(self.directory.glob("layer_*")):
            old_file.unlink()
        write_json(meta, self.fingerprint)

    def restore(self, i: int, layer: torch.nn.Module, device: torch.device) -> dict | None:
        """Load layer i's saved weights into `layer` and return its record; None if it has none."""
        weights_file, record_file = self._files(i)
        if not (self.resume and distributed.agree(record_file.is_file() and weights_file.is_file())):
            return None
        _load_layer_state(layer, load_file(str(weights_file), device=str(device)))
        log.debug("layer %d restored from %s", i, weights_file)
        return json.loads(record_file.read_text())

    def reload(self, i: int, layer: torch.nn.Module) -> bool:
        """Load layer i's saved weights into `layer` again after the walk (the final KL pass undoing
        itself); False if the layer has no checkpoint."""
        weights_file, _ = self._files(i)
        if not weights_file.is_file():
            return False
        _load_layer_state(layer, load_file(str(weights_file)))
        return True

    def save(self, i: int, layer: torch.nn.Module, record: dict) -> None:
        if not distributed.is_main():
            return  # every rank holds the same layer; rank 0 writes it
        weights_file, record_file = self._files(i)
        with atomic_path(weights_file) as tmp:
            save_file({k: v.detach().contiguous().cpu() for k, v in layer.state_dict().items()}, str(tmp))
        write_json(record_file, record)


def _load_layer_state(layer: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a checkpointed layer, rebuilding any Linear whose shape changed (structured pruning)."""
    for name, tensor in state.items():
        owner_name, _, pname = name.rpartition(".")
        owner = layer.get_submodule(owner_name) if owner_name else layer
        current = getattr(owner, pname)
        if current is None or current.shape != tensor.shape:
            if isinstance(owner, torch.nn.Linear) and pname == "weight":
                owner.in_features, owner.out_features = tensor.shape[1], tensor.shape[0]
            setattr(owner, pname, torch.nn.Parameter(tensor.clone(), requires_grad=False))
        else:
            with torch.no_grad():
                current.copy_(tensor)
