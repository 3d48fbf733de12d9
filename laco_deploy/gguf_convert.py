"""A GGUF file dequantized into a safetensors folder one tensor at a time.

transformers' own GGUF loading dequantizes every tensor into one dict and then builds the model
from it: about 2.4x the float32 model at its peak (Gemma 3 270M: 2,568 MiB for 1,071 MiB of
weights, the first build's highest peak). Here transformers' name mapping and tensor processors
(the same functions, so the weights are bit-identical) run per tensor, and the tensors go to disk
in shards as they come: the peak is about one tensor twice plus a shard.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from laco_deploy.memory import release_memory
from laco_deploy.progress import progress_bar

SHARD_BYTES = 256 * 2**20  # tensors are written out once this many bytes wait (a larger tensor gets its own shard)
# gguf-py's k-quant dequantizers make several temporaries the size of their output: a large matrix is
# dequantized this many bytes of quantized rows at a time (Gemma 3's 262k-row embedding: +2 GB at once)
DEQUANT_BLOCK_BYTES = 16 * 2**20
INDEX = "model.safetensors.index.json"

# GGUF architectures transformers' GGUF reader does not know, read as one it knows with the same keys and
# tensor layout: llama.cpp's converter writes SmolLM3 as Llama's tensors (Q/K rows reordered) under
# `smollm3`. The model is still built from config model_type `smollm3`, whose default NoPE pattern
# (every 4th layer) is the one llama.cpp fixes for that architecture.
_GGUF_READ_AS = {"smollm3": "llama"}


def teach_gguf_reader() -> None:
    """Add the _GGUF_READ_AS architectures to transformers' GGUF tables (once; a transformers that
    knows one already keeps its own entry)."""
    from transformers import modeling_gguf_pytorch_utils as reader
    from transformers.integrations import ggml

    for arch, like in _GGUF_READ_AS.items():
        if arch in reader.GGUF_SUPPORTED_ARCHITECTURES:
            continue
        ggml.GGUF_CONFIG_MAPPING[arch] = ggml.GGUF_CONFIG_MAPPING[like]
        reader.TENSOR_PROCESSORS[arch] = reader.TENSOR_PROCESSORS[like]
        reader.GGUF_SUPPORTED_ARCHITECTURES.append(arch)


def gguf_config(gguf: Path):
    """transformers' config for a GGUF file, with the keys its GGUF mapping does not read filled in
    from the file: head_dim from `{arch}.attention.key_length` (Qwen3 and Gemma heads are not
    hidden / heads wide; without it the layers are built at the wrong size), and Gemma's query
    scale, which llama.cpp's graphs take from head_dim (the GGUF has no key for it)."""
    from gguf import GGUFReader
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    reader = GGUFReader(str(gguf), "r")
    arch = reader.get_field("general.architecture").contents()
    key_length = reader.get_field(f"{arch}.attention.key_length")
    if key_length is not None and hasattr(config, "head_dim"):
        config.head_dim = int(key_length.contents())
    if hasattr(config, "query_pre_attn_scalar"):  # Gemma: llama.cpp scales queries by 1/sqrt(head_dim)
        config.query_pre_attn_scalar = config.head_dim
    config.__dict__.pop("quantization_config", None)  # the weights are written as plain floats
    return config


def write_gguf_weights(gguf: Path, config: Any, folder: Path) -> int:
    """Dequantize the GGUF's tensors into float32 safetensors shards in `folder`, named as the
    transformers model of `config` names them, with the shards' index and the config. Returns the
    bytes of weights written. Tensors the model does not have (llama.cpp's rope tables) are skipped."""
    from gguf import GGUFReader
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)  # names only: no memory for weights
    reader = GGUFReader(str(gguf), "r")
    arch, tensors = reader.get_field("general.architecture").contents(), list(reader.tensors)
    del reader  # its parsed metadata (a 262k vocabulary: ~650 MiB of small objects) is not needed for weights
    release_memory()
    settings = config.to_dict()
    processor = hf_gguf.TENSOR_PROCESSORS.get(arch, hf_gguf.TensorProcessor)(config=settings)
    names = hf_gguf.get_gguf_hf_weights_map(skeleton, processor)
    waiting: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}
    total = 0

    def flush() -> None:
        shard = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
        save_file(waiting, str(folder / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(waiting, shard))
        waiting.clear()

    for tensor in progress_bar(tensors, desc="converting GGUF", unit="tensor"):
        parsed = {"tensors": {}, "config": settings}  # what some processors stash into
        result = processor.process(weights=_dequantize(tensor), name=tensor.name,
                                   tensor_key_mapping=names, parsed_parameters=parsed)
        found = [(names[result.name], result.weights)] if result.name in names else []
        for name, weights in found + list(parsed["tensors"].items()):
            # copied only when it is not yet a fresh float32 array (an F32 tensor is a view of the read-only file)
            value = torch.from_numpy(np.require(weights, dtype=np.float32, requirements=["C", "W"]))
            if waiting and sum(t.nbytes for t in waiting.values()) + value.nbytes > SHARD_BYTES:
                flush()
            waiting[name] = value
            total += value.nbytes
    if waiting:
        flush()
    (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    config.architectures = [type(skeleton).__name__]
    config.dtype = torch.float32
    config.save_pretrained(folder)
    if skeleton.generation_config is not None:
        skeleton.generation_config.save_pretrained(folder)
    return total


def _dequantize(tensor: Any) -> np.ndarray:
    """A GGUF tensor as float32, DEQUANT_BLOCK_BYTES of its rows at a time (quantization blocks never
    cross a row, so each slice dequantizes on its own)."""
    from gguf import dequantize

    data = tensor.data
    if data.ndim < 2 or data.nbytes <= DEQUANT_BLOCK_BYTES:
        return dequantize(data, tensor.tensor_type)
    rows = max(1, DEQUANT_BLOCK_BYTES // (data.nbytes // data.shape[0]))
    first = dequantize(data[:rows], tensor.tensor_type)
    out = np.empty((data.shape[0], *first.shape[1:]), dtype=np.float32)
    out[:rows] = first
    for start in range(rows, data.shape[0], rows):
        out[start:start + rows] = dequantize(data[start:start + rows], tensor.tensor_type)
    return out
