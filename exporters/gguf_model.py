"""What a Hugging Face directory becomes in GGUF: architecture, hyper-parameters, tensors.

`plan_model(config)` reads config.json (plain JSON: no model is built) and decides the GGUF
architecture, including `deci` for structured-pruned models with per-layer widths;
`write_hparams` writes the `{arch}.*` keys; `iter_tensors` yields every tensor under its GGUF
name, in float32, with the Q/K row reordering llama.cpp's normal RoPE needs.
"""

from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import gguf
import numpy as np
import torch

from exporters.gguf_names import ARCHITECTURES, MODEL_TYPES, SKIPPED_SUFFIXES, STRUCTURED, ArchSpec
from laco_deploy.errors import ExportError

_LAYER = re.compile(r"\.layers\.(\d+)\.")
WIDTH_KEYS = ("intermediate_size", "num_attention_heads", "num_key_value_heads")


@dataclass(frozen=True)
class ModelPlan:
    hf_arch: str
    spec: ArchSpec
    n_layers: int
    hidden: int
    head_dim: int
    n_vocab: int
    widths: list[dict[str, int]]  # per layer: intermediate_size, num_attention_heads, num_key_value_heads
    per_layer: bool  # write per-layer arrays (deci)
    tied: bool | None  # None: config.json does not say; tied when there is no lm_head.weight

    @property
    def arch_name(self) -> str:
        return gguf.MODEL_ARCH_NAMES[self.spec.arch]


def read_config(model_dir: Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        raise ExportError(f"model directory {model_dir} not found; pass a Hugging Face directory (config.json + *.safetensors)")
    if not path.is_file():
        raise ExportError(f"{model_dir} has no config.json: it is not a Hugging Face model directory")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ExportError(f"{path} is not valid JSON ({e}); re-save the model") from e


def _hf_arch(config: dict[str, Any]) -> str:
    for arch in config.get("architectures") or []:
        if arch in ARCHITECTURES:
            return arch
    if config.get("model_type") in MODEL_TYPES:
        return MODEL_TYPES[config["model_type"]]
    got = ", ".join(config.get("architectures") or []) or str(config.get("model_type"))
    raise ExportError(f"architecture {got} cannot be exported to GGUF; supported: {', '.join(ARCHITECTURES)}")


def plan_model(config: dict[str, Any]) -> ModelPlan:
    """Decide architecture and layer widths from config.json."""
    hf_arch = _hf_arch(config)
    try:
        n_layers, hidden = int(config["num_hidden_layers"]), int(config["hidden_size"])
        n_heads = int(config["num_attention_heads"])
        n_vocab = int(config["vocab_size"])
        default = {"intermediate_size": int(config["intermediate_size"]), "num_attention_heads": n_heads,
                   "num_key_value_heads": int(config.get("num_key_value_heads") or n_heads)}
    except (KeyError, TypeError, ValueError) as e:
        raise ExportError(f"config.json lacks a usable {e} entry; re-save the model with transformers") from e
    head_dim = int(config.get("head_dim") or hidden // n_heads)
    widths = config.get("laco_layer_widths") or [default] * n_layers
    if len(widths) != n_layers or any(set(WIDTH_KEYS) - set(w) for w in widths):
        raise ExportError(f"config.json laco_layer_widths must hold {n_layers} entries with {', '.join(WIDTH_KEYS)}; re-run the pruning")
    widths = [{k: int(w[k]) for k in WIDTH_KEYS} for w in widths]
    for i, w in enumerate(widths):
        if w["intermediate_size"] == 0 and w["num_attention_heads"] > 0:
            raise ExportError(f"layer {i} has no FFN channels left; llama.cpp's per-layer graph (deci) would drop its "
                              "attention too. Prune less than all channels of a layer")
    _check_family(hf_arch, config, n_layers, head_dim)
    per_layer = any(w != widths[0] for w in widths)
    if per_layer and not ARCHITECTURES[hf_arch].per_layer_as_deci:
        raise ExportError(f"{hf_arch} with widths that differ between layers cannot be written as GGUF: llama.cpp's "
                          f"{gguf.MODEL_ARCH_NAMES[ARCHITECTURES[hf_arch].arch]} graph has one width for all layers and "
                          "its per-layer graph (deci) lacks this family's norms. Prune every layer by the same ratio")
    spec = STRUCTURED if per_layer else ARCHITECTURES[hf_arch]
    return ModelPlan(hf_arch, spec, n_layers, hidden, head_dim, n_vocab, widths, per_layer,
                     config.get("tie_word_embeddings"))


def _check_family(hf_arch: str, config: dict[str, Any], n_layers: int, head_dim: int) -> None:
    """Refuse settings that llama.cpp's graph for this family fixes otherwise (it would run, wrongly)."""
    spec = ARCHITECTURES[hf_arch]
    if spec.tied_only and config.get("tie_word_embeddings") is False:
        raise ExportError(f"{hf_arch} with an untied LM head cannot be written as GGUF: llama.cpp's "
                          f"{gguf.MODEL_ARCH_NAMES[spec.arch]} graph always uses the embeddings as the head")
    if spec.swa_period and config.get("layer_types"):
        p = spec.swa_period
        expected = ["sliding_attention" if i % p < p - 1 else "full_attention" for i in range(n_layers)]
        if list(config["layer_types"]) != expected:
            raise ExportError(f"layer_types {config['layer_types']} differ from llama.cpp's fixed {hf_arch} pattern "
                              f"(one full-attention layer after every {p - 1} sliding ones); cannot export to GGUF")
    local = (config.get("rope_parameters") or {}).get("sliding_attention") or {}
    if spec.local_rope_theta and float(local.get("rope_theta", spec.local_rope_theta)) != spec.local_rope_theta:
        raise ExportError(f"sliding layers' RoPE base {local['rope_theta']} differs from llama.cpp's fixed "
                          f"{spec.local_rope_theta:g} for {hf_arch}; cannot export to GGUF")
    if spec.nope_period:
        _check_nope_layers(hf_arch, config, n_layers, spec.nope_period)
    if spec.full_attention_only and "sliding_attention" in (config.get("layer_types") or ()):
        raise ExportError(f"layer_types {config['layer_types']} has sliding-window layers, which llama.cpp's "
                          f"{gguf.MODEL_ARCH_NAMES[spec.arch]} graph does not build; cannot export to GGUF "
                          "(set use_sliding_window to false)")
    scalar = config.get("query_pre_attn_scalar")
    if spec.query_scale_is_head_dim and scalar is not None and int(scalar) != head_dim:
        raise ExportError(f"query_pre_attn_scalar {scalar} differs from head_dim {head_dim}: llama.cpp's "
                          f"{hf_arch} graph scales queries by 1/sqrt(head_dim); cannot export to GGUF")


def _check_nope_layers(hf_arch: str, config: dict[str, Any], n_layers: int, period: int) -> None:
    """llama.cpp skips RoPE on layer i exactly when (i + 1) % period == 0 (fixed, not read from the file);
    config no_rope_layers (1: RoPE, 0: none; else every no_rope_layer_interval-th layer) must be that."""
    flags = config.get("no_rope_layers")
    if flags is None:
        interval = int(hf_setting(config, "no_rope_layer_interval"))
        flags = [int((i + 1) % interval != 0) for i in range(n_layers)]
    expected = [int((i + 1) % period != 0) for i in range(n_layers)]
    if [int(f) for f in flags] != expected:
        raise ExportError(f"no_rope_layers {list(flags)} differ from llama.cpp's fixed {hf_arch} pattern "
                          f"{expected} (no RoPE on every {period}th layer); cannot export to GGUF")


@functools.lru_cache(maxsize=None)
def _class_defaults(model_type: str) -> dict[str, Any]:
    from transformers import AutoConfig

    try:
        return AutoConfig.for_model(model_type).to_dict()
    except (KeyError, ValueError) as e:
        raise ExportError(f"config.json model_type {model_type!r} is unknown to transformers; re-save the model with transformers") from e


def hf_setting(config: dict[str, Any], key: str) -> Any:
    """`key` of config.json, else the default of the model's transformers config class: `save_pretrained`
    leaves out the values that equal it, and the defaults differ by family (rms_norm_eps: Phi-3 1e-5, Llama 1e-6)."""
    return config[key] if key in config else _class_defaults(str(config.get("model_type"))).get(key)


def _rope_fields(config: dict[str, Any]) -> dict[str, Any]:
    params = dict(config.get("rope_parameters") or {})
    if isinstance(params.get("full_attention"), dict):
        params = dict(params["full_attention"])
    params.update(config.get("rope_scaling") or {})
    if "rope_theta" not in params and "rope_theta" in config:
        params["rope_theta"] = config["rope_theta"]
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params["type"]
    return params


def _rope(config: dict[str, Any]) -> dict[str, Any]:
    """RoPE settings whether transformers wrote `rope_parameters` (5.x) or `rope_theta`/`rope_scaling` (4.x).
    Per-layer-type parameters (Gemma 3) give those of the full-attention layers (llama.cpp's freq_base);
    a missing `rope_theta` is the config class's default."""
    params = _rope_fields(config)
    if params.get("rope_theta") is None:
        params["rope_theta"] = _rope_fields(_class_defaults(str(config.get("model_type")))).get("rope_theta")
    return params


def write_hparams(writer: gguf.GGUFWriter, plan: ModelPlan, config: dict[str, Any]) -> None:
    """The `{arch}.*` hyper-parameters llama.cpp reads for this architecture."""
    w0 = plan.widths[0]
    col = (lambda k: [w[k] for w in plan.widths]) if plan.per_layer else (lambda k: w0[k])
    writer.add_block_count(plan.n_layers)
    writer.add_context_length(int(hf_setting(config, "max_position_embeddings")))
    writer.add_embedding_length(plan.hidden)
    writer.add_feed_forward_length(col("intermediate_size"))
    writer.add_head_count(col("num_attention_heads"))
    writer.add_head_count_kv(col("num_key_value_heads"))
    writer.add_layer_norm_rms_eps(float(hf_setting(config, "rms_norm_eps")))
    writer.add_key_length(plan.head_dim)
    writer.add_value_length(plan.head_dim)
    rope = _rope(config)
    writer.add_rope_dimension_count(int(plan.head_dim * float(rope.get("partial_rotary_factor") or 1.0)))
    writer.add_vocab_size(plan.n_vocab)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    kind = (rope.get("rope_type") or "default").lower()
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    elif kind == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(rope["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    elif kind not in ("default", "llama3"):  # llama3 is a rope_freqs tensor, see extra_tensors
        raise ExportError(f"RoPE type {kind!r} is not supported for GGUF export; supported: default, linear, yarn, llama3")
    for key, config_key, kind, default in plan.spec.extra_keys:
        value = hf_setting(config, config_key)
        value = default if value is None else value
        if value is not None:
            name = key.format(arch=plan.arch_name)
            writer.add_float32(name, float(value)) if kind is float else writer.add_uint32(name, int(value))


def extra_tensors(plan: ModelPlan, config: dict[str, Any]) -> Iterator[tuple[str, np.ndarray]]:
    """Tensors llama.cpp needs that HF computes on the fly: Llama-3 RoPE frequency factors."""
    rope = _rope(config)
    if (rope.get("rope_type") or "").lower() == "llama3":
        yield gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", llama3_rope_factors(
            plan.head_dim, float(rope["rope_theta"]), float(rope.get("factor", 8.0)),
            float(rope.get("low_freq_factor", 1.0)), float(rope.get("high_freq_factor", 4.0)),
            int(rope.get("original_max_position_embeddings", 8192)))


def llama3_rope_factors(dim: int, base: float, factor: float, low: float, high: float, old_ctx: int) -> np.ndarray:
    """Llama 3.1 frequency divisors per rotary pair: 1 for short wavelengths, `factor` for long
    ones, a smooth blend between (Meta's published formula). [dim // 2] float32."""
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * base ** (i / dim)
        if wavelen < old_ctx / high:
            out.append(1.0)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def permute_rope_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder the rows of each head from HF's half-split RoPE layout to llama.cpp's interleaved
    pairs: within a head of d rows, new row 2i = old row i and new row 2i+1 = old row i + d/2.
    weight [n_heads * d, ...] (a q/k projection or its bias) -> same shape."""
    if n_heads == 0:
        return weight
    d = weight.shape[0] // n_heads
    return weight.reshape(n_heads, 2, d // 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def safetensor_files(model_dir: Path) -> list[Path]:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        pickles = list(Path(model_dir).glob("*.bin"))
        hint = " (only pickled *.bin found: load and re-save it with safe_serialization=True)" if pickles else ""
        raise ExportError(f"{model_dir} has no *.safetensors weights{hint}")
    return files


@dataclass(frozen=True)
class TensorEntry:
    """One tensor llama.cpp loads, known from the checkpoint's header alone (no data read)."""

    name: str  # GGUF name
    key: str  # name in the safetensors file
    file: Path
    shape: tuple[int, ...]  # HF [out, in] order
    rope_heads: int | None  # q/k projections: heads whose rows are reordered for llama.cpp's RoPE
    shift: float = 0.0  # added to the values (Gemma's norms: HF stores w, llama.cpp multiplies by 1 + w)


def tensor_entries(model_dir: Path, plan: ModelPlan) -> list[TensorEntry]:
    """Every tensor llama.cpp loads, in file order, with its GGUF name and shape (headers only)."""
    from safetensors import safe_open

    names = gguf.get_tensor_name_map(plan.spec.arch, plan.n_layers)
    out = []
    for path in safetensor_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                if key.endswith(SKIPPED_SUFFIXES) or ((plan.tied or plan.spec.tied_only) and key == "lm_head.weight"):
                    continue
                name = names.get_name(key, try_suffixes=(".weight", ".bias"))
                if name is None:
                    raise ExportError(f"tensor {key} in {path.name} has no GGUF name for {plan.arch_name}; "
                                      f"is this a plain {plan.hf_arch}?")
                layer = _LAYER.search(key)
                w = plan.widths[int(layer.group(1))] if layer else None
                if w is not None and w["num_attention_heads"] == 0 and (".self_attn." in key or ".input_layernorm." in key):
                    continue  # attention-free layer: deci creates no attention tensors
                heads = None
                if plan.spec.permute_qk and w is not None:
                    heads = w["num_attention_heads"] if ".q_proj." in key else w["num_key_value_heads"] if ".k_proj." in key else None
                shift = plan.spec.norm_shift if key.endswith("norm.weight") else 0.0
                out.append(TensorEntry(name, key, path, tuple(f.get_slice(key).get_shape()), heads, shift))
    return out


def read_tensor(entry: TensorEntry) -> np.ndarray:
    """The tensor's data: float32, in HF [out, in] order, q/k rows reordered for llama.cpp's RoPE."""
    from safetensors import safe_open

    with safe_open(str(entry.file), framework="pt") as f:
        tensor = f.get_tensor(entry.key).to(torch.float32)
    if entry.rope_heads is not None:
        tensor = permute_rope_rows(tensor, entry.rope_heads)
    if entry.shift:
        tensor = tensor + entry.shift
    return tensor.contiguous().numpy()


def iter_tensors(model_dir: Path, plan: ModelPlan) -> Iterator[tuple[str, np.ndarray]]:
    """(GGUF name, float32 array in HF [out, in] order) for every tensor llama.cpp loads, one at a time."""
    for entry in tensor_entries(model_dir, plan):
        yield entry.name, read_tensor(entry)
