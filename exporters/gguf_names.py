"""HF -> GGUF knowledge as data: architectures, output types, tokenizer kinds, metadata keys.

Tensor *names* come from the `gguf` package itself (`gguf.get_tensor_name_map`, which maps
`model.layers.{bid}.self_attn.q_proj` to `blk.{bid}.attn_q` and so on); this module only says
which GGUF architecture a Hugging Face model becomes and how its layout differs per family.
Facts below were checked against llama.cpp's reference converter (convert_hf_to_gguf.py,
conversion/llama.py, conversion/deci.py) and loader (src/models/*.cpp) as vendored by
llama-cpp-python 0.3.36.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf

from laco_deploy import families

# ---- architectures -------------------------------------------------------------------------


@dataclass(frozen=True)
class ArchSpec:
    """How one Hugging Face family is written as GGUF."""

    arch: gguf.MODEL_ARCH  # GGUF architecture (`general.architecture`)
    # llama.cpp applies "normal" RoPE (rotating pairs of adjacent values) for llama/deci, while
    # HF rotates the two halves of each head; the converter therefore reorders the rows of
    # q_proj/k_proj (and their biases) inside every head. Qwen2 uses NEOX RoPE: no reordering.
    permute_qk: bool
    # Per-layer widths (structured pruning with widths that differ between layers) are written as
    # `deci`, a Llama graph: only for families whose layers are Llama's (no q/k norms, no extra norms).
    per_layer_as_deci: bool = True
    # added to every `*norm.weight` (Gemma's RMSNorm scales by 1 + w; llama.cpp's by w)
    norm_shift: float = 0.0
    # extra hyper-parameters: (GGUF key template, config.json key, float or int, default), written
    # when the config sets them or a default is given
    extra_keys: tuple[tuple[str, str, type, float | int | None], ...] = ()
    # llama.cpp has no output tensor for this architecture: the head must be tied to the embeddings
    tied_only: bool = False
    # llama.cpp fixes the sliding-window layers itself (layer i slides unless i % period == period - 1)
    # instead of reading them; the config's layer_types must agree
    swa_period: int | None = None
    # llama.cpp fixes the RoPE base of sliding layers (config rope_parameters["sliding_attention"])
    local_rope_theta: float | None = None
    # llama.cpp scales queries by 1/sqrt(head_dim); a config asking otherwise (query_pre_attn_scalar) is refused
    query_scale_is_head_dim: bool = False
    # llama.cpp fixes the layers without RoPE itself (layer i has none when (i + 1) % period == 0; there is
    # no GGUF key for it) instead of reading them; the config's no_rope_layers must agree
    nope_period: int | None = None
    # llama.cpp's graph has no sliding-window attention: a config with sliding layers is refused
    full_attention_only: bool = False


ARCHITECTURES: dict[str, ArchSpec] = {
    # Llama 1/2/3, SmolLM, TinyLlama: arch `llama`; optional q/k/v/o and MLP biases are
    # read by llama.cpp's llama loader when present; tied heads reuse token_embd.
    "LlamaForCausalLM": ArchSpec(gguf.MODEL_ARCH.LLAMA, permute_qk=True),
    # Mistral 7B: the converter writes it as `llama` too (sliding_window is not used by llama.cpp).
    "MistralForCausalLM": ArchSpec(gguf.MODEL_ARCH.LLAMA, permute_qk=True),
    # Qwen2 / Qwen2.5: arch `qwen2`, q/k/v biases (attn_q.bias ...), NEOX RoPE, usually untied.
    "Qwen2ForCausalLM": ArchSpec(gguf.MODEL_ARCH.QWEN2, permute_qk=False),
    # Qwen3: arch `qwen3`, Qwen2's hyper-parameters plus per-head q/k RMSNorms (attn_q_norm,
    # attn_k_norm, [head_dim]); NEOX RoPE, no biases; small models tie the head.
    "Qwen3ForCausalLM": ArchSpec(gguf.MODEL_ARCH.QWEN3, permute_qk=False, per_layer_as_deci=False),
    # Gemma 2 (conversion/gemma.py Gemma2Model): arch `gemma2`; every norm + 1; attention and final
    # soft-capping and the window as hyper-parameters; lm_head never written (llama.cpp's gemma2 has no
    # output tensor); llama.cpp applies the sqrt(hidden) embedding scale and the post-norms itself.
    "Gemma2ForCausalLM": ArchSpec(
        gguf.MODEL_ARCH.GEMMA2, permute_qk=False, per_layer_as_deci=False, norm_shift=1.0, tied_only=True,
        extra_keys=((gguf.Keys.LLM.ATTN_LOGIT_SOFTCAPPING, "attn_logit_softcapping", float, None),
                    (gguf.Keys.LLM.FINAL_LOGIT_SOFTCAPPING, "final_logit_softcapping", float, None),
                    (gguf.Keys.Attention.SLIDING_WINDOW, "sliding_window", int, None)),
        swa_period=2, query_scale_is_head_dim=True),
    # Gemma 3 text (Gemma3Model): arch `gemma3`; norms (q/k norms too) + 1; rope.freq_base is the
    # full-attention layers' base, the sliding layers' base is fixed at 1e4 by llama.cpp.
    "Gemma3ForCausalLM": ArchSpec(
        gguf.MODEL_ARCH.GEMMA3, permute_qk=False, per_layer_as_deci=False, norm_shift=1.0,
        extra_keys=((gguf.Keys.LLM.FINAL_LOGIT_SOFTCAPPING, "final_logit_softcapping", float, None),
                    (gguf.Keys.Attention.SLIDING_WINDOW, "sliding_window", int, None)),
        swa_period=6, local_rope_theta=10000.0, query_scale_is_head_dim=True),
    # Phi-3 (conversion/phi.py Phi3MiniModel): arch `phi3`; fused qkv_proj -> attn_qkv and gate_up_proj
    # -> ffn_up ([gate; up] rows, split by llama.cpp) written as they are; NEOX RoPE; the original
    # context length, and the sliding window (0: none), as hyper-parameters.
    "Phi3ForCausalLM": ArchSpec(
        gguf.MODEL_ARCH.PHI3, permute_qk=False, per_layer_as_deci=False,
        extra_keys=((gguf.Keys.Rope.SCALING_ORIG_CTX_LEN, "original_max_position_embeddings", int, None),
                    (gguf.Keys.Attention.SLIDING_WINDOW, "sliding_window", int, 0))),
    # SmolLM3 (conversion/llama.py SmolLM3Model, a LlamaModel): arch `smollm3`, Llama's tensors with Q/K rows
    # reordered (normal RoPE); llama.cpp hard-codes its NoPE layers (n_no_rope_layer_step = 4 in
    # load_arch_hparams) and builds no sliding window; per-layer widths would need `deci`, which ropes every layer.
    "SmolLM3ForCausalLM": ArchSpec(gguf.MODEL_ARCH.SMOLLM3, permute_qk=True, per_layer_as_deci=False, nope_period=4,
                                   full_attention_only=True),
}
MODEL_TYPES = families.MODEL_TYPES  # config.json model_type -> the class above (laco_deploy/families.py)

# Structured-pruned models whose layers differ in FFN width or head count. llama.cpp's `llama`
# loader sizes every layer from layer 0's counts; `deci` (DeciLM / Nemotron-NAS) reads
# `{arch}.feed_forward_length`, `{arch}.attention.head_count` and `.head_count_kv` as per-layer
# arrays and builds each layer with its own width (src/models/deci.cpp). It uses normal RoPE
# like llama (so Q/K rows are reordered), accepts optional q/k/v/o and FFN biases, and needs
# `attention.key_length`/`value_length` because head_dim cannot be inferred from layer 0.
# deci treats head_count == 0 as an attention-free layer (no attn_norm, no attention tensors);
# feed_forward_length == 0 drops the whole layer *including* its attention, so it is refused.
STRUCTURED = ArchSpec(gguf.MODEL_ARCH.DECI, permute_qk=True)

# HF tensor names never written (recomputed by llama.cpp).
SKIPPED_SUFFIXES = (".rotary_emb.inv_freq", ".attention.masked_bias")

# Norm weights and every 1-D tensor stay F32 in every output type, as the converter does.
F32_SUFFIXES = ("_norm.weight",)

# ---- output types --------------------------------------------------------------------------


@dataclass(frozen=True)
class QuantSpec:
    file_type: gguf.LlamaFileType  # `general.file_type`
    tensor_type: gguf.GGMLQuantizationType | None  # written directly by the gguf package; None: k-quant
    llama_ftype: str | None = None  # llama_cpp constant used by llama_model_quantize


QUANTS: dict[str, QuantSpec] = {
    "f32": QuantSpec(gguf.LlamaFileType.ALL_F32, gguf.GGMLQuantizationType.F32),
    "f16": QuantSpec(gguf.LlamaFileType.MOSTLY_F16, gguf.GGMLQuantizationType.F16),
    "bf16": QuantSpec(gguf.LlamaFileType.MOSTLY_BF16, gguf.GGMLQuantizationType.BF16),
    "q8_0": QuantSpec(gguf.LlamaFileType.MOSTLY_Q8_0, gguf.GGMLQuantizationType.Q8_0),
    # k-quants: an F32 file is written first, then llama.cpp's own quantizer picks per-tensor
    # types (Q4_K_M mixes Q4_K, Q6_K and, for rows not a multiple of 256, Q5_0/Q8_0 fallbacks).
    "q4_k_m": QuantSpec(gguf.LlamaFileType.MOSTLY_Q4_K_M, None, "LLAMA_FTYPE_MOSTLY_Q4_K_M"),
    "q5_k_m": QuantSpec(gguf.LlamaFileType.MOSTLY_Q5_K_M, None, "LLAMA_FTYPE_MOSTLY_Q5_K_M"),
    "q6_k": QuantSpec(gguf.LlamaFileType.MOSTLY_Q6_K, None, "LLAMA_FTYPE_MOSTLY_Q6_K"),
    # the small (_S) mixes: fewer tensors promoted to more bits than their _M siblings
    "q5_k_s": QuantSpec(gguf.LlamaFileType.MOSTLY_Q5_K_S, None, "LLAMA_FTYPE_MOSTLY_Q5_K_S"),
    "q4_k_s": QuantSpec(gguf.LlamaFileType.MOSTLY_Q4_K_S, None, "LLAMA_FTYPE_MOSTLY_Q4_K_S"),
    # below 4 bits: mostly the dense model's size rivals for the frontier's equal-size comparison
    "q3_k_m": QuantSpec(gguf.LlamaFileType.MOSTLY_Q3_K_M, None, "LLAMA_FTYPE_MOSTLY_Q3_K_M"),
    "q3_k_s": QuantSpec(gguf.LlamaFileType.MOSTLY_Q3_K_S, None, "LLAMA_FTYPE_MOSTLY_Q3_K_S"),
    "q2_k": QuantSpec(gguf.LlamaFileType.MOSTLY_Q2_K, None, "LLAMA_FTYPE_MOSTLY_Q2_K"),
}

# ---- tokenizer -----------------------------------------------------------------------------

# llama.cpp picks the pre-tokenizer regex from `tokenizer.ggml.pre` (src/llama-vocab.cpp).
# The converter finds it by hashing a test string's tokens; we recognise the HF tokenizer.json
# pre_tokenizer structure instead. Each entry: (name, predicate over the list of steps).
# Steps are the pre_tokenizer dict, or the items of a "Sequence".
LLAMA3_SPLIT = (
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)
QWEN2_SPLIT = (
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)


def _is_bytelevel(step: dict, regex: bool) -> bool:
    return step.get("type") == "ByteLevel" and bool(step.get("use_regex", True)) == regex


def _split_regex(step: dict) -> str | None:
    if step.get("type") != "Split":
        return None
    pattern = step.get("pattern") or {}
    return pattern.get("Regex")


PRE_TOKENIZERS: list[tuple[str, object]] = [
    # GPT-2: ByteLevel with its built-in regex and nothing else.
    ("gpt-2", lambda s: len(s) == 1 and _is_bytelevel(s[0], regex=True)),
    # SmolLM / StarCoder-style: digits split one by one, then GPT-2 ByteLevel regex.
    ("smollm", lambda s: len(s) == 2 and s[0].get("type") == "Digits" and s[0].get("individual_digits")
     and _is_bytelevel(s[1], regex=True)),
    # Llama 3: one Split with the Llama-3 regex, then ByteLevel without a regex.
    ("llama-bpe", lambda s: len(s) == 2 and _split_regex(s[0]) == LLAMA3_SPLIT and _is_bytelevel(s[1], regex=False)),
    # Qwen2: same shape, single-digit numbers.
    ("qwen2", lambda s: len(s) == 2 and _split_regex(s[0]) == QWEN2_SPLIT and _is_bytelevel(s[1], regex=False)),
]

# ---- metadata ------------------------------------------------------------------------------

# When the model came from a GGUF file, its `tokenizer.*` keys and these `general.*` keys are
# carried over unchanged. Keys describing the *file* (its type, alignment, architecture) are
# rewritten for the new file instead.
GENERAL_NOT_CARRIED = ("general.architecture", "general.file_type", "general.quantization_version", "general.alignment")
LACO_PREFIX = "laco_deploy"  # pruning/compensation settings live under laco_deploy.*
EXPORTER_KEY = f"{LACO_PREFIX}.exporter"  # "laco-deploy VERSION" in every GGUF it writes
