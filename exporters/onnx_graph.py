"""Trace a Hugging Face decoder with KV cache into one ONNX graph (prefill and decode).

The graph follows optimum's `ORTModelForCausalLM` conventions:

    inputs   input_ids [batch, seq] int64, attention_mask [batch, past + seq] int64,
             position_ids [batch, seq] int64,
             past_key_values.N.key / .value [batch, kv_heads_N, past, head_dim]
    outputs  logits [batch, seq, vocab],
             present.N.key / .value [batch, kv_heads_N, past + seq, head_dim]

Prefill feeds an empty past (past = 0); decode feeds the previous step's presents. kv_heads_N
is a fixed number per layer (structured pruning may make it differ between layers).

optimum-onnx pins transformers < 5, so the graph is traced with `torch.onnx.export(dynamo=True)`
of a thin wrapper whose forward takes the past as flat tensors, rebuilds a `DynamicCache`,
and returns the logits plus the cache's tensors flattened in the same order.
"""

from __future__ import annotations

import inspect
import logging
import math
import re
from pathlib import Path
from typing import Any

import torch

from laco_deploy.structured import layer_widths

log = logging.getLogger(__name__)

# Trace with sizes above 1 so torch.export keeps batch / sequence / past symbolic.
_TRACE_BATCH, _TRACE_SEQ, _TRACE_PAST = 2, 5, 3
WEIGHT_INLINE_BYTES = 1024  # tensors up to this size stay inside model.onnx, larger ones go to the data file
STREAM_BYTES = 64 * 2**20  # weights in flight while streaming them to disk (onnx_ir's default: 1 GiB)
DIM_NAMES = {"batch": "batch_size", "seq": "sequence_length", "past": "past_sequence_length",
             "total": "total_sequence_length"}


def io_names(n_layers: int) -> tuple[list[str], list[str]]:
    """Graph input and output names, in positional order (optimum's names)."""
    past = [f"past_key_values.{i}.{kind}" for i in range(n_layers) for kind in ("key", "value")]
    present = [f"present.{i}.{kind}" for i in range(n_layers) for kind in ("key", "value")]
    return ["input_ids", "attention_mask", "position_ids", *past], ["logits", *present]


def kv_shapes(config: Any) -> list[tuple[int, int]]:
    """(kv_heads, head_dim) of each decoder layer, honouring structured-pruning widths."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return [(w["num_key_value_heads"], head_dim) for w in layer_widths(config)]


def _cache_argument(model: torch.nn.Module) -> str:
    """transformers 5 renames `past_key_values` to `cache`; use whichever forward accepts."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class KVDecoder(torch.nn.Module):
    """Wrap a causal LM so its forward takes and returns flat key/value tensors."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model
        self.n_layers = model.config.num_hidden_layers
        self.cache_arg = _cache_argument(model)

    def forward(self, input_ids, attention_mask, position_ids, *past):
        """input_ids [b, s], attention_mask [b, p + s], position_ids [b, s], past 2 x layers of
        [b, kv, p, d] -> (logits [b, s, vocab], present 2 x layers of [b, kv, p + s, d])."""
        from transformers.cache_utils import DynamicCache

        pairs = [(past[2 * i], past[2 * i + 1]) for i in range(self.n_layers)]
        cache = DynamicCache(ddp_cache_data=pairs, config=self.model.config)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=True, **{self.cache_arg: cache})
        new_cache = getattr(out, "cache", None) or out.past_key_values
        present = []
        for layer in new_cache.layers:
            present += [layer.keys, layer.values]
        return (out.logits, *present)


def _trace_inputs(config: Any, dtype: torch.dtype) -> tuple:
    b, s, p = _TRACE_BATCH, _TRACE_SEQ, _TRACE_PAST
    ids = torch.randint(0, config.vocab_size, (b, s))
    mask = torch.ones(b, p + s, dtype=torch.long)
    pos = torch.arange(p, p + s).expand(b, s).contiguous()
    past = tuple(torch.randn(b, kv, p, d, dtype=dtype) for kv, d in kv_shapes(config) for _ in range(2))
    return ids, mask, pos, past


def trace(model: torch.nn.Module, path: Path, data_file: str):
    """Export `model` (on CPU, in the dtype it holds) to `path`, its weights streamed to `data_file`
    beside it, with symbolic batch, sequence and past lengths -> the graph as an onnx.ModelProto
    whose weights stay in that file (external data). Raises whatever torch.export raises; the
    caller wraps it.

    Streaming the weights from the exporter's own model to disk, instead of converting it to an
    in-memory ModelProto first, keeps one copy of the weights fewer in memory (issue 33)."""
    import onnx
    import onnx_ir

    wrapper = KVDecoder(model).eval()
    dtype = next(model.parameters()).dtype
    ids, mask, pos, past = _trace_inputs(model.config, dtype)
    dyn = torch.export.Dim.DYNAMIC
    two_d = {0: dyn, 1: dyn}
    shapes = (two_d, two_d, two_d, tuple({0: dyn, 2: dyn} for _ in past))
    names_in, names_out = io_names(model.config.num_hidden_layers)
    with torch.no_grad():
        program = torch.onnx.export(wrapper, (ids, mask, pos, *past), dynamo=True, dynamic_shapes=shapes,
                                    input_names=names_in, output_names=names_out,
                                    optimize=True, verbose=False)
    (path.parent / data_file).unlink(missing_ok=True)
    onnx_ir.save(program.model, path, external_data=data_file, size_threshold_bytes=WEIGHT_INLINE_BYTES,
                 max_in_flight_bytes=STREAM_BYTES)
    release_weights(program.model)
    del program
    forget_export_state()
    proto = onnx.load(str(path), load_external_data=False)
    for node in proto.graph.node:  # per-node debug records (FX node, stack trace): not needed to run
        del node.metadata_props[:]
    rename_dims(proto)
    name_weights(proto, model, path.parent)
    return proto


def release_weights(model) -> None:
    """Drop the traced onnx_ir `model`'s references to its weights once they are on disk.

    onnxscript's rewrite rules (module-level objects; onnxscript 0.7) keep the last graph they
    matched after torch.onnx.export(optimize=True) returns, and with it every initializer: the
    model's parameters and the folded, transposed copies that are views of them. transformers
    maps the whole safetensors file as one storage, so one surviving parameter keeps all of it
    resident: measured on SmolLM2-135M fp32, 513 MiB stayed mapped through the parity check
    after the PyTorch model was deleted (issue 33)."""
    for value in model.graph.initializers.values():
        value.const_value = None
    model.graph.initializers.clear()


def forget_export_state() -> None:
    """Drop what torch.export keeps after it returns: its non-strict fake-tensor leak detection
    (torch 2.13) leaves the traced FX graph's nodes in a module-level map,
    proxy_tensor._FAKE_TENSOR_ID_TO_PROXY_MAP_FOR_EXPORT, until the next export. On SmolLM2-135M
    that graph (37,000 nodes, their fake tensors and symbolic shapes) held ~200 MiB through the
    parity check (issue 33). A torch without the map is left alone."""
    from torch.fx.experimental import proxy_tensor

    leftover = getattr(proxy_tensor, "_FAKE_TENSOR_ID_TO_PROXY_MAP_FOR_EXPORT", None)
    if isinstance(leftover, dict):
        leftover.clear()
    _forget_rewriter_state()


def _forget_rewriter_state() -> None:
    """onnxscript's rewrite rules are module-level objects whose matchers keep the last graph and
    node they matched (onnxscript 0.7: `_graph`, `_current_node`, `_match`): the exported ONNX graph,
    whose nodes keep their torch.fx nodes in their metadata, and with them the whole FX graph.
    Reset that state on every rule the loaded onnxscript.rewriter modules define."""
    import sys

    from onnxscript.rewriter import RewriteRule, RewriteRuleSet

    for name, module in list(sys.modules.items()):
        if not name.startswith("onnxscript.rewriter") or module is None:
            continue
        for obj in list(vars(module).values()):
            rules = obj.rules if isinstance(obj, RewriteRuleSet) else [obj] if isinstance(obj, RewriteRule) else []
            for matcher in (getattr(rule, "_matcher", None) for rule in rules):
                for field in ("_graph", "_current_node", "_match", "_tracer"):
                    if getattr(matcher, field, None) is not None:
                        setattr(matcher, field, None)


def empty_weights(module: torch.nn.Module) -> None:
    """Give up the storage of `module`'s parameters and buffers (each becomes an empty tensor).

    After torch.onnx.export, onnx_ir's graph keeps the parameters it lifted from graph inputs in its
    bookkeeping, and onnxscript's rewrite rules keep that graph (see release_weights): a traced model
    deleted by its owner stays resident. Emptying the parameters in place frees their storage
    whoever still refers to the Parameter objects. For a model whose weights are on disk already."""
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)


def name_weights(proto, model: torch.nn.Module, folder: Path | None = None) -> None:
    """Name the folded, transposed linear weights (val_123) after their parameters
    ("model.layers.0.mlp.up_proj.weight.T") so metadata, sparse storage and tools read well.
    `folder`: where the weights of a proto with external data are. Both sides are hashed in
    slices of about HASH_BYTES (weight_digest, initializer_digest): no whole transposed copy of
    a weight, nor a whole initializer, is held (the tied head of SmolLM2-135M alone is 108 MiB)."""
    wanted: dict[tuple, str] = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            out_features, in_features = module.weight.shape
            key = ((in_features, out_features), _np_dtype_str(module.weight.dtype), weight_digest(module.weight))
            wanted[key] = f"{name}.weight.T"
    renames: dict[str, str] = {}
    taken = {t.name for t in proto.graph.initializer}
    for init in proto.graph.initializer:
        if len(init.dims) != 2 or not init.name.startswith("val_"):
            continue
        new = wanted.get((tuple(init.dims), _onnx_dtype_str(init.data_type), initializer_digest(init, folder)))
        if new and new not in taken:
            renames[init.name] = new
            taken.add(new)
            init.name = new
    for node in proto.graph.node:
        for i, name in enumerate(node.input):
            if name in renames:
                node.input[i] = renames[name]


HASH_BYTES = 16 * 2**20  # slice size when hashing weights for name_weights


def weight_digest(weight: torch.Tensor) -> str:
    """sha1 of the bytes of weight.t().contiguous() ([in, out], C order), hashed in row slices."""
    import hashlib

    digest = hashlib.sha1()
    w = weight.detach()  # [out, in]
    step = max(1, HASH_BYTES // max(1, w.shape[0] * w.element_size()))
    for start in range(0, w.shape[1], step):
        digest.update(w[:, start:start + step].t().contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()


def initializer_digest(init, folder: Path | None) -> str:
    """sha1 of an initializer's little-endian bytes: read from its external data file in slices,
    or from the proto itself."""
    import hashlib

    from onnx import TensorProto, numpy_helper
    from onnx.external_data_helper import ExternalDataInfo
    from onnx.helper import tensor_dtype_to_np_dtype

    digest = hashlib.sha1()
    if init.data_location != TensorProto.EXTERNAL:
        digest.update(numpy_helper.to_array(init).tobytes())
        return digest.hexdigest()
    info = ExternalDataInfo(init)
    left = info.length or math.prod(init.dims) * tensor_dtype_to_np_dtype(init.data_type).itemsize
    with open(Path(folder or ".") / info.location, "rb") as f:
        f.seek(info.offset or 0)
        while left:
            chunk = f.read(min(left, HASH_BYTES))
            if not chunk:
                break
            digest.update(chunk)
            left -= len(chunk)
    return digest.hexdigest()


def _np_dtype_str(dtype: torch.dtype) -> str:
    return str(torch.empty(0, dtype=dtype).numpy().dtype.str)


def _onnx_dtype_str(data_type: int) -> str:
    from onnx.helper import tensor_dtype_to_np_dtype

    return tensor_dtype_to_np_dtype(data_type).str


def rename_dims(proto) -> None:
    """Give the exporter's symbols (s10, s70 + s89, ...) optimum's names on graph inputs/outputs."""
    roles = {"input_ids": ("batch", "seq"), "attention_mask": ("batch", "total"), "position_ids": ("batch", "seq")}
    mapping: dict[str, str] = {}
    for value in proto.graph.input:
        axes = roles.get(value.name) or (("batch", None, "past", None) if value.name.startswith("past_key_values.") else ())
        for dim, role in zip(value.type.tensor_type.shape.dim, axes):
            if role and dim.dim_param:
                mapping[dim.dim_param] = DIM_NAMES[role]
    token = re.compile(r"\bs\d+\b")
    for value in list(proto.graph.input) + list(proto.graph.output):
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param:
                dim.dim_param = token.sub(lambda m: mapping.get(m.group(0), m.group(0)), dim.dim_param)
