"""The boundary every run goes through once: settings validated and inputs checked before slow work.

A build (`check_build`), a stage command and a library call of a stage's `run` each get a
`Checked` here: the settings passed `validate()`, the model source and the texts the run reads
passed the checks that need no model loaded (models.check_source, data.check_texts), and the
device is resolved. A stage's work (`run_checked`) trusts it and checks none of it again; inside a
build the stages are handed the build's one `Checked`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from laco_deploy.config import BuildConfig, CompensateConfig, DataConfig, FidelityConfig, ModelConfig, PruneConfig
from laco_deploy.data import check_texts
from laco_deploy.errors import ConfigError
from laco_deploy.models import check_source, resolve_device


@dataclass(frozen=True)
class Checked:
    """Settings and inputs that passed the boundary, and the device they run on. A stage's section
    is None when the run does not include that stage."""

    model: ModelConfig
    data: DataConfig
    device: torch.device
    prune: PruneConfig | None = None
    compensate: CompensateConfig | None = None
    fidelity: FidelityConfig | None = None


def check(model: ModelConfig, data: DataConfig, device: torch.device | None = None, *, prune: PruneConfig | None = None,
          compensate: CompensateConfig | None = None, fidelity: FidelityConfig | None = None,
          reads_inputs: bool = True) -> Checked:
    """Validate the settings of the stages given (every problem at once), then check what they read
    (unless `reads_inputs` is off: a copy reads neither): the model source, the calibration texts
    (prune, compensate) and the evaluation texts (fidelity). `device`: already resolved (a build's),
    else resolved from model.device."""
    errors = model.validate() + data.validate() + [e for s in (prune, compensate, fidelity) if s is not None
                                                   for e in s.validate()]
    if errors:
        raise ConfigError("; ".join(errors))
    if reads_inputs:
        check_source(model.model, allow_pickle=model.allow_pickle, trust_remote_code=model.trust_remote_code,
                     seqlen=data.seqlen)
        if prune is not None or compensate is not None:
            check_texts(data.calib, "calib")
        if fidelity is not None:
            check_texts(data.eval, "eval")
    return Checked(model, data, device if device is not None else resolve_device(model.device), prune, compensate,
                   fidelity)


def check_build(cfg: BuildConfig) -> Checked:
    """A build's boundary: the device first, then every setting and every input of every stage
    (zero-shot task files are the fidelity stage's: pipeline.check_tasks)."""
    device = resolve_device(cfg.model.device)
    return check(cfg.model, cfg.data, device, prune=cfg.prune, compensate=cfg.compensate, fidelity=cfg.fidelity)
