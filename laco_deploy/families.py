"""The model families laco-deploy supports: one table, read by the loader, the stages and both exporters.

Every family has a decoder layer of attention + gated MLP with RMSNorms and RoPE (SmolLM3: on most
layers); what differs between them (which linears exist, which norms, what the head does to the
logits, how residual streams are written) is a field of its `Family` record, so stages ask the table instead of
testing architecture names. How a family is written as GGUF is data in exporters/gguf_names.py
(keyed by the same class names).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from laco_deploy.errors import ConfigError

LLAMA_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
LLAMA_FFN = ("gate_proj", "up_proj", "down_proj")
LLAMA_NORMS = ("input_layernorm", "post_attention_layernorm")
# Linears whose output is added to the residual stream, and the norm whose input is that stream
# (None: the layer's input). compensate/lsq.py folds the residual error into their targets.
LLAMA_RESIDUAL_WRITERS = {"self_attn.o_proj": None, "mlp.down_proj": "post_attention_layernorm"}
GEMMA_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


@dataclass(frozen=True)
class Family:
    """One Hugging Face model family, as the stages see it."""

    hf_class: str  # config.json `architectures`
    model_type: str  # config.json `model_type`
    label: str  # for messages
    layer_class: str  # transformers' decoder-layer class (stages that only hold a layer find the family by it)
    attention: tuple[str, ...] = LLAMA_ATTENTION  # prunable attention linears (short names)
    ffn: tuple[str, ...] = LLAMA_FFN  # prunable MLP linears (short names)
    norms: tuple[str, ...] = LLAMA_NORMS  # norm modules of a decoder layer (--train-norms)
    residual_writers: dict[str, str | None] = field(default_factory=lambda: dict(LLAMA_RESIDUAL_WRITERS))
    # config key of the tanh soft-capping the causal-LM head applies to the logits (Gemma 2), or None
    logit_softcap_key: str | None = None
    # fused linears -> the projections they hold, in row order (Phi-3: q/k/v in qkv_proj, gate/up in
    # gate_up_proj); targets name projections, a fused linear is pruned when all its parts are named
    fused: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # whole KV head groups can be removed per layer (Phi-3 splits its fused qkv by the model-wide head count)
    structured_heads: bool = True
    # LaCo's layer loss when compensate.loss is unset. Gemma's residual stream carries a few channels
    # ~1000x the median: a per-token nmse is all theirs and lets the rest drift (held-out KL of the walk
    # 0.86 -> 3.27 with nmse, -> 0.33 per channel; RESULTS.md); SmolLM2 does better per token (0.49 vs 0.53)
    layer_loss: str = "nmse"
    # LaCo's AdamW rate when compensate.lr is unset. AdamW moves each weight by ~lr a step whatever its
    # size: 3e-3 suits SmolLM2's linears (RMS ~0.19); Gemma's (~0.04, its scale is in the (1 + w) norms)
    # closed more of every domain's gap at 3e-4 than at 3e-3 or 1e-4 at 256 samples (RESULTS.md)
    layer_lr: float = 3e-3

    def module_names(self, targets: tuple[str, ...] | list[str]) -> tuple[str, ...]:
        """Short names of the layer's linears the targets (projection names) select."""
        return tuple(name for name in self.attention + self.ffn
                     if any(part in targets for part in self.fused.get(name, (name,))))

    def check_targets(self, targets: tuple[str, ...] | list[str]) -> None:
        """Refuse targets that split a fused linear (it is pruned as one matrix) or select nothing."""
        for name, parts in self.fused.items():
            asked = [p for p in parts if p in targets]
            if asked and len(asked) != len(parts):
                raise ConfigError(f"{self.label} fuses {', '.join(parts)} into one {name}: target all of them or "
                                  f"none (got {', '.join(asked)})")
        if not self.module_names(targets):
            raise ConfigError(f"prune.targets {','.join(targets)} selects no linear of {self.label}")


TABLE: tuple[Family, ...] = (
    Family("LlamaForCausalLM", "llama", "Llama, SmolLM", "LlamaDecoderLayer"),  # Llama 1/2/3, SmolLM, TinyLlama
    Family("MistralForCausalLM", "mistral", "Mistral", "MistralDecoderLayer"),
    Family("Qwen2ForCausalLM", "qwen2", "Qwen2", "Qwen2DecoderLayer"),  # Qwen2 / Qwen2.5
    # Qwen3 dense: RMSNorm on each head's queries and keys (q_norm, k_norm) before RoPE
    Family("Qwen3ForCausalLM", "qwen3", "Qwen3", "Qwen3DecoderLayer",
           norms=LLAMA_NORMS + ("self_attn.q_norm", "self_attn.k_norm")),
    # Gemma 2: embeddings scaled by sqrt(hidden) (in the embedding module), (1 + w) RMSNorms, norms
    # before and after attention and MLP (their outputs are normalised before the residual add: no
    # residual writers), attention and final-logit tanh soft-capping, alternating sliding-window and
    # full-attention layers (config.layer_types; the engine gives each its own mask), tied head
    Family("Gemma2ForCausalLM", "gemma2", "Gemma 2", "Gemma2DecoderLayer",
           norms=GEMMA_NORMS, residual_writers={}, logit_softcap_key="final_logit_softcapping",
           layer_loss="channel_nmse", layer_lr=3e-4),
    # Gemma 3 (text): Gemma 2's layer with q/k norms instead of attention soft-capping, five sliding
    # layers (local RoPE base) per full layer (global RoPE base): per-type masks and RoPE tables
    Family("Gemma3ForCausalLM", "gemma3_text", "Gemma 3", "Gemma3DecoderLayer",
           norms=GEMMA_NORMS + ("self_attn.q_norm", "self_attn.k_norm"), residual_writers={},
           logit_softcap_key="final_logit_softcapping", layer_loss="channel_nmse", layer_lr=3e-4),
    # Phi-3 / Phi-3.5 mini: Llama's layer with q/k/v fused into qkv_proj ([q; k; v] rows) and gate/up
    # into gate_up_proj ([gate; up] rows); NEOX RoPE; untied head
    Family("Phi3ForCausalLM", "phi3", "Phi-3", "Phi3DecoderLayer", attention=("qkv_proj", "o_proj"),
           ffn=("gate_up_proj", "down_proj"),
           fused={"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")},
           structured_heads=False),
    # SmolLM3: Llama's layer, but the layers config.no_rope_layers marks 0 (every 4th by default) apply
    # no RoPE; each attention module reads its own flag, so the engine passes every layer the same
    # position embeddings; tied head
    Family("SmolLM3ForCausalLM", "smollm3", "SmolLM3", "SmolLM3DecoderLayer"),
)

BY_CLASS = {f.hf_class: f for f in TABLE}
ARCHITECTURES = {f.hf_class: f.model_type for f in TABLE}  # HF class -> model_type
MODEL_TYPES = {f.model_type: f.hf_class for f in TABLE}  # model_type -> HF class
NAMES = ", ".join(f.label for f in TABLE)  # for messages
_BY_LAYER = {f.layer_class: f for f in TABLE}


def of_config(config: Any) -> Family | None:
    """The family of a transformers config (or config.json dict), None when unsupported."""
    get = config.get if isinstance(config, dict) else lambda k: getattr(config, k, None)
    for arch in get("architectures") or []:
        if arch in BY_CLASS:
            return BY_CLASS[arch]
    return BY_CLASS.get(MODEL_TYPES.get(get("model_type")))


def of_layer(layer: Any) -> Family:
    """The family of a decoder layer, by its class; Llama's layout for a layer we do not know."""
    return _BY_LAYER.get(type(layer).__name__, TABLE[0])


def layer_loss(config: Any) -> str:
    """LaCo's layer loss for a model of this config when the user names none."""
    family = of_config(config)
    return family.layer_loss if family is not None else "nmse"


def layer_lr(config: Any) -> float:
    """LaCo's learning rate for a model of this config when the user names none."""
    family = of_config(config)
    return family.layer_lr if family is not None else Family.layer_lr


def logit_softcap(config: Any) -> float | None:
    """The cap of the family's logit soft-capping (logits = cap * tanh(logits / cap)), or None."""
    family = of_config(config)
    key = family.logit_softcap_key if family is not None else None
    value = getattr(config, key, None) if key else None
    return float(value) if value else None
