"""The model-level guard of a LaCo run: on held-out samples the recovered model must be closer to
the dense model's next-token distribution than the pruned model it started from, or the pruned
weights come back.

Each layer's fit is guarded by its own held-out loss (train.py) and the final KL pass by the walk's
result (distill.py), but neither compares the whole model with the pruned one. On Gemma 3 270M fed
windows without its BOS token (issue 31) every layer kept a lower held-out loss while the model's KL
to dense rose from 1.34 to 1.66 nats. So before the walk the guard keeps the pruned model's final
hidden states of the held-out samples ([n, seq, hidden], a few MB), and after it scores them and
the recovered model against the dense logits: the walk's last dense hidden states through the final
norm and LM head, the teacher of the final KL pass (pruning and LaCo never change those two).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable

import torch

from laco_deploy import distributed, families
from laco_deploy.compensate.klpass import head_logits, kl_to_teacher
from laco_deploy.engine.cache import ActivationCache
from laco_deploy.sizing import KL_CHUNK_TOKENS

log = logging.getLogger(__name__)


class ModelGuard:
    """Keeps the pruned model's held-out outputs before the walk; `check` afterwards."""

    def __init__(self, restore_pruned: Callable[[Any], None]):
        """restore_pruned(model): puts the pruned weights back (restore_layers_from(the pruned folder))."""
        self.restore_pruned = restore_pruned
        self.pruned: torch.Tensor | None = None  # [local held-out rows, seq, hidden], after the final norm
        self.record: dict[str, Any] | None = None

    def capture(self, model, input_ids: torch.Tensor, rows: torch.Tensor, device: torch.device, batch_size: int) -> None:
        """The pruned model's final hidden states of this rank's held-out rows (before the walk)."""
        self.pruned = _final_hidden(model, input_ids[rows], device, batch_size)

    def check(self, model, input_ids: torch.Tensor, rows: torch.Tensor, n_global: int, teacher: ActivationCache,
              device: torch.device, batch_size: int) -> dict[str, Any]:
        """Mean token KL(dense || model) on the held-out rows for the pruned and the recovered model;
        the pruned weights come back unless the recovered model is closer. Returns the record."""
        assert self.pruned is not None, "capture() before check()"
        softcap = families.logit_softcap(model.config)
        sums = [0.0, 0.0]
        with torch.no_grad(), _on(model, device):
            recovered = _final_hidden(model, input_ids[rows], device, batch_size)
            for j in range(len(rows)):  # one sample, KL_CHUNK_TOKENS tokens at a time: [seq, vocab] logits are
                dense_hidden = teacher.rows(rows[j:j + 1], device)  # large (Gemma 3: 134 MB per 128 tokens)
                seq = dense_hidden.shape[1]
                for s in range(0, seq, KL_CHUNK_TOKENS):
                    dense = head_logits(model, dense_hidden[:, s:s + KL_CHUNK_TOKENS], softcap, norm=True)
                    for k, hidden in enumerate((self.pruned, recovered)):
                        student = head_logits(model, hidden[j:j + 1, s:s + KL_CHUNK_TOKENS].to(device), softcap, norm=False)
                        sums[k] += float(kl_to_teacher(student, dense)) * dense.shape[1] / seq
        kl_pruned, kl_recovered = (s / max(1, n_global) for s in distributed.all_reduce_floats(sums))
        kept = kl_recovered < kl_pruned
        if not kept:
            self.restore_pruned(model)
            log.warning("LaCo made the model worse than the pruned one on held-out samples (KL to the dense logits "
                        "%.4g pruned vs %.4g recovered): the pruned weights are kept", kl_pruned, kl_recovered)
        self.record = {"kl_pruned": round(kl_pruned, 6), "kl_recovered": round(kl_recovered, 6), "kept": kept,
                       "samples": n_global}
        self.pruned = None
        return self.record


@contextlib.contextmanager
def _on(model, device: torch.device):
    """The whole model on `device` for the block, back on CPU after (where the walk keeps it)."""
    model.to(device)
    try:
        yield
    finally:
        model.to("cpu")


@torch.no_grad()
def _final_hidden(model, ids: torch.Tensor, device: torch.device, batch_size: int) -> torch.Tensor:
    """The model's last hidden states after its final norm, on CPU. ids [n, seq] -> [n, seq, hidden].
    n may be 0: under torchrun a rank can hold none of the held-out samples."""
    if not len(ids):
        return torch.empty(0)
    with _on(model, device):
        out = [model.model(input_ids=chunk.to(device), use_cache=False).last_hidden_state.float().cpu()
               for chunk in ids.split(batch_size)]
    return torch.cat(out) if out else torch.empty(0)


def restore_layers_from(folder) -> Callable[[Any], None]:
    """A function that copies every decoder layer's weights of the model saved in `folder` (the
    pruned model's safetensors) back into a model, one layer at a time."""
    from pathlib import Path

    from safetensors import safe_open

    from laco_deploy.models import decoder_layers

    def restore(model) -> None:
        where = {}
        for f in sorted(Path(folder).glob("*.safetensors")):
            with safe_open(str(f), "pt") as h:
                where.update({k: f for k in h.keys()})
        for i, layer in enumerate(decoder_layers(model)):
            prefix = f"model.layers.{i}."
            with torch.no_grad():
                for name, p in layer.state_dict(keep_vars=True).items():
                    with safe_open(str(where[prefix + name]), "pt") as h:
                        p.copy_(h.get_tensor(prefix + name))

    return restore
