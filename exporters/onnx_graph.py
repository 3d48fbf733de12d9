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
from typing import Any, NamedTuple

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


def _trace_inputs(config: Any, dtype: torch.dtype, device: str = "cpu") -> tuple:
    b, s, p = _TRACE_BATCH, _TRACE_SEQ, _TRACE_PAST
    ids = torch.randint(0, config.vocab_size, (b, s), device=device)
    mask = torch.ones(b, p + s, dtype=torch.long, device=device)
    pos = torch.arange(p, p + s, device=device).expand(b, s).contiguous()
    past = tuple(torch.randn(b, kv, p, d, dtype=dtype, device=device) for kv, d in kv_shapes(config) for _ in range(2))
    return ids, mask, pos, past


def trace(model: torch.nn.Module, path: Path, data_file: str):
    """Export `model` (on CPU, in the dtype it holds) to `path`, its weights streamed to `data_file`
    beside it, with symbolic batch, sequence and past lengths -> the graph as an onnx.ModelProto
    whose weights stay in that file (external data). Consumes `model`: its weights go to a scratch
    file beside `path` and the model to the meta device. Raises whatever torch.export raises; the
    caller wraps it.

    Traced on the meta device (issue 33): tracing real weights held them, and onnxscript's folded,
    transposed copy of each, beside the tracer's graph (export child on SmolLM2-135M fp32: ~1.3 GiB;
    on meta the trace itself peaks ~260 MiB above the interpreter). Each initializer then reads its
    tensor back from the scratch file when the data file is written (stream_weights)."""
    import onnx
    import onnx_ir
    import onnxscript.optimizer

    from laco_deploy.memory import release_memory

    scratch = path.parent / SCRATCH_FILE
    try:
        stash = stash_weights(model, scratch)
        model.to("meta")
        release_memory()
        program = _export_on_meta(model)
        stream_weights(program.model.graph, stash, scratch)
        onnxscript.optimizer.optimize_ir(program.model)  # what torch.onnx.export(optimize=True) runs
        (path.parent / data_file).unlink(missing_ok=True)
        onnx_ir.save(program.model, path, external_data=data_file, size_threshold_bytes=WEIGHT_INLINE_BYTES,
                     max_in_flight_bytes=STREAM_BYTES)
    finally:
        scratch.unlink(missing_ok=True)
    release_weights(program.model)
    del program
    forget_export_state()
    proto = onnx.load(str(path), load_external_data=False)
    for node in proto.graph.node:  # per-node debug records (FX node, stack trace): not needed to run
        del node.metadata_props[:]
    rename_dims(proto)
    return proto


def _export_on_meta(model: torch.nn.Module):
    """torch.onnx.export of KVDecoder(model), weights and example inputs on the meta device, without
    onnxscript's optimizer (it folds constants by computing them, and meta tensors hold no values)."""
    wrapper = KVDecoder(model).eval()
    dtype = next(model.parameters()).dtype
    ids, mask, pos, past = _trace_inputs(model.config, dtype, "meta")
    dyn = torch.export.Dim.DYNAMIC
    two_d = {0: dyn, 1: dyn}
    shapes = (two_d, two_d, two_d, tuple({0: dyn, 2: dyn} for _ in past))
    names_in, names_out = io_names(model.config.num_hidden_layers)
    with torch.no_grad():
        return torch.onnx.export(wrapper, (ids, mask, pos, *past), dynamo=True, dynamic_shapes=shapes,
                                 input_names=names_in, output_names=names_out, optimize=False, verbose=False)


SCRATCH_FILE = "weights.scratch"  # the model's tensors while the graph is traced on meta (deleted after)
WRAPPER_PREFIX = "model."  # KVDecoder's attribute: traced names are "model." + the model's own names


class Slot(NamedTuple):
    """Where stash_weights put one tensor in the scratch file."""

    offset: int
    dtype: str  # numpy dtype string
    shape: tuple[int, ...]


def stash_weights(model: torch.nn.Module, scratch: Path) -> dict[str, Slot]:
    """Write each parameter and buffer of `model` once to `scratch`, one tensor at a time -> its slot
    by traced name (WRAPPER_PREFIX + name). Tied tensors share one slot."""
    slots: dict[str, Slot] = {}
    seen: dict[tuple, Slot] = {}
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    with open(scratch, "wb") as f:
        for name, tensor in named:
            key = (tensor.data_ptr(), tuple(tensor.shape), tensor.dtype)
            if key not in seen:
                array = tensor.detach().contiguous().numpy()
                seen[key] = Slot(f.tell(), array.dtype.str, tuple(array.shape))
                f.write(array.data if array.size else b"")
            slots[WRAPPER_PREFIX + name] = seen[key]
    return slots


def _lazy(scratch: Path, slot: Slot, transpose: bool = False):
    """An onnx_ir tensor that reads `slot` from `scratch` (transposed: a 2-D tensor's [1, 0]) each
    time its bytes are asked for, so no more than the one being written is in memory."""
    import numpy as np
    import onnx_ir as ir

    def load():
        array = np.fromfile(scratch, dtype=np.dtype(slot.dtype), count=math.prod(slot.shape), offset=slot.offset)
        array = array.reshape(slot.shape)
        return ir.tensor(np.ascontiguousarray(array.T) if transpose else array)

    shape = slot.shape[::-1] if transpose else slot.shape
    return ir.LazyTensor(load, dtype=ir.DataType.from_numpy(np.dtype(slot.dtype)), shape=ir.Shape(shape))


def stream_weights(graph, slots: dict[str, Slot], scratch: Path) -> None:
    """Give the meta-traced `graph` its weights, read from `scratch` as they are written: tied
    initializers become one; a 2-D weight read only by a Transpose [1, 0] (every linear layer's
    x @ W.T) becomes one transposed initializer named after the module ("model.layers.0.mlp.up_proj
    .weight.T"), as onnxscript's folding made it from real weights."""
    import onnx_ir as ir

    first: dict[Slot, Any] = {}
    for name, value in list(graph.initializers.items()):
        if name not in slots:
            raise RuntimeError(f"traced initializer {name} is none of the model's parameters or buffers")
        slot = slots[name]
        if slot in first:
            value.replace_all_uses_with(first[slot])
            graph.initializers.pop(name)
            continue
        first[slot] = value
        value.const_value = _lazy(scratch, slot)
    for node in list(graph):
        weight = node.inputs[0] if node.op_type == "Transpose" and node.inputs else None
        if weight is None or not weight.is_initializer() or len(weight.uses()) != 1:
            continue
        slot, perm = slots[weight.name], node.attributes.get("perm")
        if len(slot.shape) != 2 or (perm is not None and list(perm.as_ints()) != [1, 0]):
            continue
        lazy = _lazy(scratch, slot, transpose=True)
        folded = ir.Value(name=weight.name[len(WRAPPER_PREFIX):] + ".T", type=ir.TensorType(weight.dtype),
                          shape=lazy.shape, const_value=lazy)
        graph.register_initializer(folded)
        node.outputs[0].replace_all_uses_with(folded)
        graph.remove(node, safe=True)
        graph.initializers.pop(weight.name)


def release_weights(model) -> None:
    """Drop the traced onnx_ir `model`'s references to its weights once they are on disk.

    onnxscript's rewrite rules (module-level objects; onnxscript 0.7) keep the last graph they
    matched after the optimizer returns, and with it every initializer (see _forget_rewriter_state)."""
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
