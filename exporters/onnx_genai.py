"""`genai_config.json`: what onnxruntime-genai needs to run an ONNX export folder as it is.

onnxruntime-genai (`og.Model(folder)`, its generate loop, its tokenizer) reads the graph through the
names in this file, so the same folder serves optimum's ORTModelForCausalLM, our OrtDecoder and
onnxruntime-genai. The graph's names are those of exporters.onnx_graph: input_ids, attention_mask
(total length), position_ids, past_key_values.N.key/value in, logits and present.N.key/value out;
the present tensors are the past concatenated with the new step, so the buffers are not shared.

genai sizes one key/value cache for all layers, so a structured model whose layers keep different
numbers of KV heads gets no genai_config.json (`genai_config` says why); different FFN widths are fine.
Its parity check (greedy tokens equal to PyTorch's) is laco_deploy.runtimes.genai.genai_match.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

GENAI_FILE = "genai_config.json"


def _kv_heads(config: dict[str, Any]) -> tuple[int | None, str]:
    """The one KV head count of every layer, or (None, why not)."""
    widths = config.get("laco_layer_widths")
    default = int(config.get("num_key_value_heads") or config["num_attention_heads"])
    if not widths:
        return default, ""
    counts = sorted({int(w["num_key_value_heads"]) for w in widths})
    if len(counts) > 1:
        return None, (f"layers keep {counts} KV heads and onnxruntime-genai sizes one cache for all layers; "
                      "run this folder with onnxruntime or optimum")
    return counts[0], ""


def genai_config(config: dict[str, Any], generation: dict[str, Any] | None, *, sparse_storage: bool) -> tuple[dict | None, str]:
    """genai_config.json for an export of the model with this config.json (and generation_config.json),
    or (None, the reason it cannot run in onnxruntime-genai)."""
    if sparse_storage:
        return None, "sparse storage keeps the weights outside the graph; onnxruntime-genai loads the graph alone"
    if "sliding_attention" in (config.get("layer_types") or ()):
        return None, ("sliding-window layers keep a shorter cache than full-attention layers and "
                      "onnxruntime-genai sizes one cache for all layers (Gemma 3: present shape mismatch)")
    kv_heads, why = _kv_heads(config)
    if kv_heads is None:
        return None, why
    generation = generation or {}
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    context = int(config.get("max_position_embeddings") or 2048)
    eos, pad = (generation.get(k, config.get(k)) for k in ("eos_token_id", "pad_token_id"))
    first_eos = eos[0] if isinstance(eos, list) and eos else eos
    decoder = {
        "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
        "filename": "model.onnx",
        "head_size": int(config.get("head_dim") or hidden // heads),
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_hidden_layers": int(config["num_hidden_layers"]),
        "num_key_value_heads": kv_heads,
        "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask", "position_ids": "position_ids",
                   "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"},
        "outputs": {"logits": "logits", "present_key_names": "present.%d.key", "present_value_names": "present.%d.value"},
    }
    model = {
        "type": str(config["model_type"]),
        "bos_token_id": generation.get("bos_token_id", config.get("bos_token_id")),
        "eos_token_id": eos,
        "pad_token_id": pad if pad is not None else first_eos,
        "context_length": context,
        "vocab_size": int(config["vocab_size"]),
        "decoder": decoder,
    }
    search = {  # greedy by default, as the parity check runs it; callers set their own options per request
        "do_sample": False, "num_beams": 1, "num_return_sequences": 1, "max_length": context, "min_length": 0,
        "temperature": 1.0, "top_k": 1, "top_p": 1.0, "repetition_penalty": 1.0, "length_penalty": 1.0,
        "diversity_penalty": 0.0, "no_repeat_ngram_size": 0, "early_stopping": True,
        "past_present_share_buffer": False,
    }
    return {"model": model, "search": search}, ""


def write_genai_config(folder: Path, *, sparse_storage: bool) -> list[str]:
    """Write genai_config.json into an export folder that holds config.json (and maybe
    generation_config.json) -> notes for the export result."""
    config = json.loads((folder / "config.json").read_text())
    gen_file = folder / "generation_config.json"
    generation = json.loads(gen_file.read_text()) if gen_file.is_file() else None
    doc, why = genai_config(config, generation, sparse_storage=sparse_storage)
    if doc is None:
        return [f"no {GENAI_FILE}: {why}"]
    (folder / GENAI_FILE).write_text(json.dumps(doc, indent=2) + "\n")
    return [f"{GENAI_FILE} written: the folder also runs in onnxruntime-genai (og.Model(folder))"]
