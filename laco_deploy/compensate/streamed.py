"""Which weights compensation keeps in RAM, and the sparsity measured tensor by tensor.

The dense twin is only ever read one decoder layer at a time, so it always streams from its
safetensors (engine.lazy.LazyModel, nothing loaded but the layer in use) unless its weights are
pickles. The pruned model is trained in place: in RAM by default, or streamed with `--offload disk`,
which is also chosen automatically (and said in the log) when the pruned model would not fit in the
available RAM. Streamed, only the current layer pair is in memory, trained layers spill to the
checkpoint folder and the result is written shard by shard (LazyModel.save).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from laco_deploy.compensate.masks import model_sparsity, weights_sparsity
from laco_deploy.config import CompensateConfig, ModelConfig
from laco_deploy.engine import LazyModel
from laco_deploy.errors import ModelError
from laco_deploy.models import decoder_layers, linear_modules, load_model, local_model_dir, save_model
from laco_deploy.sizing import FP32, available_bytes, model_bytes

log = logging.getLogger(__name__)
GIB = 2**30
RAM_SHARE = 0.8  # the pruned model stays in RAM while it needs at most this share of the available memory


@dataclass
class Models:
    """The dense twin and the pruned model of one compensation run."""

    dense: Any  # causal LM: a LazyModel skeleton (dense_lazy set) or resident
    sparse: Any  # causal LM: resident, or a skeleton whose layers stream (sparse_lazy set)
    tokenizer: Any
    dense_lazy: LazyModel | None = None
    sparse_lazy: LazyModel | None = None

    def resident(self) -> list[Any]:
        """The models held whole in RAM."""
        return [m for m, lazy in ((self.sparse, self.sparse_lazy), (self.dense, self.dense_lazy)) if lazy is None]


def _has_safetensors(path: Path) -> bool:
    return any(Path(path).glob("*.safetensors"))


def open_dense(model_cfg: ModelConfig) -> tuple[Any, LazyModel | None]:
    """The dense model as a skeleton whose layers stream from safetensors (or whole, for pickles)."""
    path = local_model_dir(model_cfg.model)
    if _has_safetensors(path):
        lazy = LazyModel.open(path, rest=False)
        return lazy.model, lazy
    loaded = load_model(model_cfg.model, allow_pickle=model_cfg.allow_pickle, trust_remote_code=model_cfg.trust_remote_code)
    return loaded.model, None


def resolve_offload(cfg: CompensateConfig, sparse_dir: Path, tokens: int) -> CompensateConfig:
    """`cfg`, with offload "disk" when the pruned model and the activations of `tokens` calibration
    tokens (sparse and dense path, the dense one's inputs too where the step reads them: at most
    3 caches, each layer's outputs overwriting its inputs) would not fit in RAM."""
    if cfg.offload == "disk" or cfg.method != "laco":
        return cfg
    size = model_bytes(sparse_dir)
    need, free = size["total"] + 3 * tokens * size["hidden"] * FP32, available_bytes()
    if free is None or need <= RAM_SHARE * free:
        return cfg
    log.info("compensate: the pruned model and its activations need about %.1f GiB but %.1f GiB of RAM is available; "
             "streaming its layers from disk instead (as with compensate.offload disk)", need / GIB, free / GIB)
    return dataclasses.replace(cfg, offload="disk")


def open_models(model_cfg: ModelConfig, sparse_dir: Path, cfg: CompensateConfig, spill_dir: Path) -> Models:
    """Dense twin streamed; pruned model resident, or streamed (spilling to `spill_dir`) with offload disk."""
    from laco_deploy.tokenizer import load_tokenizer

    dense, dense_lazy = open_dense(model_cfg)
    if cfg.offload == "disk" and cfg.method == "laco":
        if not _has_safetensors(sparse_dir):
            raise ModelError(f"{sparse_dir} has no *.safetensors; compensate.offload disk streams layers from safetensors files only")
        sparse_lazy = LazyModel.open(sparse_dir, spill_dir=spill_dir, rest=False)  # embeddings: only to embed the samples
        tokenizer = load_tokenizer(sparse_dir)
        return Models(dense, sparse_lazy.model, tokenizer, dense_lazy, sparse_lazy)
    if cfg.method == "lora":
        log.info("the LoRA baseline trains the whole pruned model at once: it holds its %.2f GiB of fp32 weights in RAM "
                 "(compensate.offload applies to LaCo only)", model_bytes(sparse_dir)["total"] / GIB)
    loaded = load_model(str(sparse_dir))
    return Models(dense, loaded.model, loaded.tokenizer, dense_lazy, None)


def _streamed_weights(lazy: LazyModel, targets: tuple[str, ...]):
    """(matrix key, weight) of every prunable linear in layer order, one layer read at a time (the
    trained layer's spill file once it exists, else the source files)."""
    for i, layer in enumerate(decoder_layers(lazy.model)):
        state = lazy.layer_state(i)
        for name in linear_modules(layer, targets):
            yield f"model.layers.{i}.{name}", state[f"{name}.weight"]


def sparsity(model, lazy: LazyModel | None, targets: tuple[str, ...], numel: dict[str, int]) -> dict:
    """masks.model_sparsity of a resident model, or of a streamed one read layer by layer."""
    if lazy is None:
        return model_sparsity(model, targets, numel)
    return weights_sparsity(_streamed_weights(lazy, targets), numel)


def save(models: Models, out_dir: Path, extra_files: dict[str, str]) -> None:
    """Write the compensated model: whole (resident) or shard by shard from the spilled layers."""
    if models.sparse_lazy is None:
        save_model(models.sparse, models.tokenizer, out_dir, extra_files=extra_files)
    else:
        models.sparse_lazy.save(out_dir, models.tokenizer, extra_files=extra_files)
