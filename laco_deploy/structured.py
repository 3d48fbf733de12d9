"""Per-layer widths of structured-pruned models (smaller FFN / fewer heads in some layers).

When every layer has the same widths (what `--structured` produces: one ratio for all layers),
they are written in transformers' own keys (`intermediate_size`, `num_attention_heads`,
`num_key_value_heads`, with `head_dim` pinned because fewer heads would change hidden/heads), so
the folder loads in plain `AutoModelForCausalLM.from_pretrained` and in any tool that reads it.

transformers' Llama assumes one width for all layers, so a model whose layers differ records its
widths in config.json under `laco_layer_widths`, one entry per decoder layer, and names the loader
that reads them under `laco_loader` (plain transformers stops with a size-mismatch error):

    {"intermediate_size": 768, "num_attention_heads": 6, "num_key_value_heads": 2}

Heads are removed in whole KV groups (a KV head with the query heads that share it), so the
GQA ratio, head_dim and RoPE are unchanged and attention infers its head count from the
projection shapes. Loading builds the model at full size, shrinks each layer's linears to the
recorded shapes, then loads the safetensors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

WIDTHS_KEY = "laco_layer_widths"
LOADER_KEY = "laco_loader"  # config.json: what loads a model with per-layer widths
LOADER = "laco_deploy.models.load_model (pip install laco-deploy); plain transformers cannot build per-layer widths"
WIDTH_KEYS = ("intermediate_size", "num_attention_heads", "num_key_value_heads")


def has_layer_widths(config: Any) -> bool:
    return bool(getattr(config, WIDTHS_KEY, None))


def layer_widths(config: Any) -> list[dict[str, int]]:
    """Widths per layer; a plain config gives its uniform widths."""
    widths = getattr(config, WIDTHS_KEY, None)
    if widths:
        return [dict(w) for w in widths]
    return [
        {
            "intermediate_size": config.intermediate_size,
            "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": config.num_key_value_heads,
        }
        for _ in range(config.num_hidden_layers)
    ]


def write_widths(config: Any, widths: list[dict[str, int]]) -> None:
    """Record the widths of each decoder layer in `config` (saved as config.json): transformers' own
    keys when all layers agree, `laco_layer_widths` + `laco_loader` when they differ."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if all(w == widths[0] for w in widths):
        config.head_dim = head_dim  # before the head count changes: hidden / heads would no longer be it
        for key in WIDTH_KEYS:
            setattr(config, key, int(widths[0][key]))
        for key in (WIDTHS_KEY, LOADER_KEY):
            if hasattr(config, key):
                delattr(config, key)
    else:
        setattr(config, WIDTHS_KEY, [{k: int(w[k]) for k in WIDTH_KEYS} for w in widths])
        setattr(config, LOADER_KEY, LOADER)


def loads_in_plain_transformers(config: Any) -> bool:
    """Whether `AutoModelForCausalLM.from_pretrained` builds this model without our loader."""
    return not has_layer_widths(config)


def _resize_linear(linear: torch.nn.Linear, out_features: int, in_features: int) -> torch.nn.Linear:
    new = torch.nn.Linear(in_features, out_features, bias=linear.bias is not None, dtype=linear.weight.dtype,
                          device=linear.weight.device)
    return new


def shrink_layer(layer: torch.nn.Module, width: dict[str, int], head_dim: int) -> None:
    """Replace a decoder layer's linears with empty ones of the recorded widths (weights loaded later)."""
    attn, mlp = layer.self_attn, layer.mlp
    hidden = attn.o_proj.out_features
    if hasattr(attn, "q_proj"):  # a fused qkv_proj (Phi-3) keeps every head: nothing to resize
        q_out = width["num_attention_heads"] * head_dim
        kv_out = width["num_key_value_heads"] * head_dim
        attn.q_proj = _resize_linear(attn.q_proj, q_out, hidden)
        attn.k_proj = _resize_linear(attn.k_proj, kv_out, hidden)
        attn.v_proj = _resize_linear(attn.v_proj, kv_out, hidden)
        attn.o_proj = _resize_linear(attn.o_proj, hidden, q_out)
    if hasattr(attn, "num_key_value_groups") and width["num_key_value_heads"]:
        attn.num_key_value_groups = width["num_attention_heads"] // width["num_key_value_heads"]
    ffn = width["intermediate_size"]
    if hasattr(mlp, "gate_up_proj"):  # Phi-3: [gate; up] rows
        mlp.gate_up_proj = _resize_linear(mlp.gate_up_proj, 2 * ffn, hidden)
    else:
        mlp.gate_proj = _resize_linear(mlp.gate_proj, ffn, hidden)
        mlp.up_proj = _resize_linear(mlp.up_proj, ffn, hidden)
    mlp.down_proj = _resize_linear(mlp.down_proj, hidden, ffn)


def load_structured(path: Path, config: Any):
    """Build the model from `config`, shrink layers to `laco_layer_widths`, load safetensors from `path`."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from laco_deploy.errors import ModelError

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    widths = layer_widths(config)
    if len(widths) != config.num_hidden_layers:
        raise ModelError(f"{path}/config.json: {WIDTHS_KEY} has {len(widths)} entries for {config.num_hidden_layers} layers; re-run the pruning")
    for layer, width in zip(model.model.layers, widths):
        shrink_layer(layer, width, head_dim)
    state: dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        state.update(load_file(str(f)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ModelError(f"{path}: weights do not match laco_layer_widths (missing {missing[:3]}, unexpected {unexpected[:3]}); re-run the pruning")
    if config.tie_word_embeddings:
        model.tie_weights()
    return model


def skeleton(config) -> torch.nn.Module:
    """The causal LM of `config` on `meta` (no memory), decoder layers at their per-layer widths."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if has_layer_widths(config):
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        for layer, width in zip(model.model.layers, layer_widths(config)):
            shrink_layer(layer, width, head_dim)
    return model.eval()


def skeleton_of(path: Path, trust_remote_code: bool = False):
    """The causal LM of the HF directory `path` on `meta` (reads config.json only)."""
    from transformers import AutoConfig

    from laco_deploy.errors import ModelError

    try:
        config = AutoConfig.from_pretrained(Path(path), trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:  # unreadable, or a model type only its own code defines
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelError(f"cannot read {Path(path) / 'config.json'}: {first}") from e
    return skeleton(config)
