"""The model families laco-deploy supports: one table, read by the loader and both exporters.

Every family here has Llama's decoder layout (q/k/v/o + gate/up/down linears, RMSNorm, RoPE), so
the layer engine, pruning and LaCo treat them alike. How a family is written as GGUF is data in
exporters/gguf_names.py (keyed by the same class names).
"""

from __future__ import annotations

# Hugging Face class (config.json `architectures`) -> family (config.json `model_type`)
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",  # Llama 1/2/3, SmolLM, TinyLlama
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",  # Qwen2 / Qwen2.5
    "Qwen3ForCausalLM": "qwen3",  # Qwen3 dense: RMSNorm on each head's queries and keys (q_norm, k_norm)
}
MODEL_TYPES = {family: arch for arch, family in ARCHITECTURES.items()}  # model_type -> class
NAMES = "Llama, SmolLM, Mistral, Qwen2, Qwen3"  # for messages
