"""Checks run right after a GGUF export: read it back, and compare llama.cpp with PyTorch.

`logit_agreement` is the math (pure tensors); `parity` runs both models on the first window of
the builtin evaluation text, fed the same token ids, and also compares the two tokenizers.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Any

import gguf
import torch

from laco_deploy.errors import ExportError

log = logging.getLogger(__name__)

PARITY_TOKENS = 128  # tokens of evaluation text compared right after export (a fixed check, not a setting)


def logit_agreement(ref: torch.Tensor, cand: torch.Tensor) -> dict[str, float]:
    """Top-1 agreement and mean KL(ref || cand) in nats over positions. ref, cand: [seq, vocab].
    KL in float64 row chunks (fidelity.metrics.token_kl): a full [seq, vocab] float64 pass would
    be the export's largest allocation."""
    from laco_deploy.fidelity.metrics import token_kl

    kl = token_kl(ref, cand)  # [seq]
    top1 = (ref.argmax(-1) == cand.argmax(-1)).double().mean()
    return {"top1": float(top1), "mean_kl": float(kl.mean()), "max_kl": float(kl.max())}


def read_back(path: Path) -> dict[str, Any]:
    """What the gguf reader sees: architecture, tensor count and types, laco-deploy metadata."""
    try:
        reader = gguf.GGUFReader(str(path), "r")
    except Exception as e:  # the reader raises bare ValueError/struct errors on a bad file
        raise ExportError(f"the GGUF file just written ({path}) cannot be read back ({e}); check free disk space and retry") from e
    arch = reader.get_field("general.architecture")
    laco = {k: reader.get_field(k).contents() for k in reader.fields if k.startswith("laco_deploy.")}
    return {
        "architecture": arch.contents() if arch else None,
        "n_tensors": len(reader.tensors),
        "tensor_types": dict(Counter(t.tensor_type.name for t in reader.tensors)),
        "laco_deploy_keys": sorted(laco),
    }


def parity(model_dir: Path, gguf_path: Path, n_tokens: int = PARITY_TOKENS) -> dict[str, Any]:
    """llama.cpp vs PyTorch next-token logits on the same evaluation tokens, and tokenizer agreement."""
    from transformers import AutoTokenizer

    from laco_deploy.bench.llamacpp import LlamaCppRunner
    from laco_deploy.data import evaluation_stream, load_texts
    from laco_deploy.engine.forward import model_logits

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    stream = evaluation_stream(tokenizer, "builtin", max_tokens=n_tokens)
    # the PyTorch reference runs on the layer engine (one decoder layer in memory), before llama.cpp loads
    ref = model_logits(model_dir, stream, torch.device("cpu"))
    runner = LlamaCppRunner(gguf_path, threads=1, n_ctx=max(n_tokens, 16))  # a check, not a speed run: 1 thread is robust on busy machines
    try:
        cand = runner.logits(stream)
        out = {f"parity_{k}": round(v, 8) for k, v in logit_agreement(ref, cand).items()}
        out["parity_tokens"] = int(stream.numel())
        text = load_texts("builtin", "eval")[0][:2000]
        hf_ids = tokenizer.encode(text, add_special_tokens=True)
        ll_ids = runner.tokenize(text)
    finally:
        runner.close()
    same = sum(a == b for a, b in zip(hf_ids, ll_ids, strict=False))
    out["tokenizer_match"] = hf_ids == ll_ids
    out["tokenizer_agreement"] = round(same / max(len(hf_ids), len(ll_ids), 1), 4)
    return out
