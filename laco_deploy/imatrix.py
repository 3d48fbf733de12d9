"""Importance matrices for llama.cpp's quantizer, computed as `llama-imatrix` does: per input column
of every weight matrix in the decoder layers, the mean of the squared input over the calibration
tokens. That is Wanda's ||X_j||^2 / tokens, so the layer engine and prune.stats gather it; the
file is llama.cpp's GGUF imatrix (exporters.gguf_imatrix), which `export --imatrix` and
`llama-quantize --imatrix` both read.

Like llama-imatrix, the LM head is left out (llama.cpp advises against weighting it) and the
embeddings have no input to weigh (a row lookup).

    compute(model_dir, data_cfg, out) -> ImatrixResult
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from laco_deploy import data as data_mod
from laco_deploy.config import IMATRIX_CALIB, PRUNABLE_LINEARS, DataConfig
from laco_deploy.engine import Lane, WalkOptions, capture_inputs, walk_layers
from laco_deploy.errors import ConfigError
from laco_deploy.models import linear_modules, load_model
from laco_deploy.prune.stats import collect_input_stats

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ImatrixResult:
    path: str
    entries: int  # weight matrices with importance data
    samples: int  # calibration samples (llama.cpp's "chunks")
    seqlen: int  # tokens per sample
    calib: str
    wall_s: float

    def to_dict(self) -> dict:
        return asdict(self)


@torch.no_grad()
def input_square_sums(model, input_ids: torch.Tensor, device: torch.device,
                      batch_size: int = 8) -> dict[str, tuple[np.ndarray, int]]:
    """Walk the decoder layers on the calibration samples; per linear (HF name, e.g.
    `model.layers.0.self_attn.q_proj`) the sum over tokens of its squared inputs [in] and the token count."""
    out: dict[str, tuple[np.ndarray, int]] = {}

    def step(ctx) -> None:
        stats = collect_input_stats(ctx, linear_modules(ctx.layer, PRUNABLE_LINEARS), hessian=False)
        for name, s in stats.items():
            out[f"model.layers.{ctx.index}.{name}"] = (s.sq_sum.double().cpu().numpy(), s.tokens)

    inputs = capture_inputs(model, None, input_ids, device)
    walk_layers(Lane(model, inputs), step, WalkOptions(device, batch_size, "imatrix"))
    return out


def compute(model_dir: Path, data_cfg: DataConfig, out: Path, *, device: torch.device | None = None,
            batch_size: int = 8) -> ImatrixResult:
    """The importance matrix of the Hugging Face model in `model_dir` on `data_cfg`'s calibration
    samples, written to `out` in llama.cpp's GGUF imatrix format."""
    from exporters import gguf_imatrix, gguf_model

    errors = data_cfg.validate()
    if errors:
        raise ConfigError("; ".join(errors))
    data_mod.check_texts(data_cfg.calib, "calib")
    t0 = time.perf_counter()
    device = device if device is not None else torch.device("cpu")
    loaded = load_model(str(model_dir))
    ids = data_mod.calibration_samples(loaded.tokenizer, data_cfg.calib, data_cfg.samples, data_cfg.seqlen, data_cfg.seed)
    sums = input_square_sums(loaded.model, ids, device, batch_size)
    del loaded
    plan = gguf_model.plan_model(gguf_model.read_config(Path(model_dir)))
    gguf_names = {e.key.removesuffix(".weight"): e.name for e in gguf_model.tensor_entries(Path(model_dir), plan)}
    named = {gguf_names[k]: v for k, v in sums.items() if k in gguf_names}
    gguf_imatrix.write(out, {n: s for n, (s, _) in named.items()}, {n: t for n, (_, t) in named.items()},
                       datasets=[data_cfg.calib], chunk_count=data_cfg.samples, chunk_size=data_cfg.seqlen,
                       arch=plan.arch_name)
    log.info("imatrix of %d weights over %d x %d tokens -> %s", len(named), data_cfg.samples, data_cfg.seqlen, out)
    return ImatrixResult(str(out), len(named), data_cfg.samples, data_cfg.seqlen, data_cfg.calib,
                         round(time.perf_counter() - t0, 2))



_LAYER_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(.+)\.weight$")  # model.layers.3.self_attn.q_proj.weight
TRAINED_FILE = "imatrix.gguf"  # in a QA-LaCo output folder: the importance matrix its quantizer was weighted by


def linear_importance(path: Path, model_dir: Path) -> dict[str, torch.Tensor]:
    """The importance matrix in `path` as llama.cpp's quantizer receives it (exporters.gguf_imatrix.read),
    per decoder linear of the model in `model_dir`: {"<layer>.<module>" e.g. "3.self_attn.q_proj": [in] float32}
    (the keys compensate.fakequant takes). Weights the file has no data for are left out (quantized unweighted)."""
    from exporters import gguf_imatrix, gguf_model

    values = gguf_imatrix.read(Path(path)).values
    plan = gguf_model.plan_model(gguf_model.read_config(Path(model_dir)))
    out = {}
    for entry in gguf_model.tensor_entries(Path(model_dir), plan):
        found = _LAYER_KEY.search(entry.key)
        if found and entry.name in values:
            out[f"{found[1]}.{found[2]}"] = torch.from_numpy(values[entry.name].copy())
    if not out:
        raise ConfigError(f"importance matrix {path} names none of {model_dir}'s decoder weights (e.g. "
                          f"{next(iter(values))}); compute it on this model with `laco-deploy imatrix` or set "
                          f"compensate.quant_imatrix to {IMATRIX_CALIB}")
    return out


def trained_with(model_dir: Path) -> Path | None:
    """The importance matrix QA-LaCo trained `model_dir`'s weights through (compensate.quant_imatrix), whose
    grid an export with an importance matrix must reproduce; None where it trained through none."""
    path = Path(model_dir) / TRAINED_FILE
    return path if path.is_file() else None
