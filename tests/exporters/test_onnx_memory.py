"""What the ONNX export holds after tracing (issue 33): neither the traced weights nor the traced
graphs outlive the trace (torch.export and onnxscript keep them in module-level state), and the
graph traced on the meta device gets the model's weights back from the scratch file."""

from __future__ import annotations

import gc
import logging
import shutil
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from exporters import onnx as onnx_exporter
from exporters import onnx_graph
from laco_deploy.models import load_model


def _mapped(path: Path) -> bool:
    """Whether this process maps `path` (transformers maps a safetensors file as one storage)."""
    return str(path.resolve()) in Path("/proc/self/maps").read_text()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_traced_weights_are_released(tiny_llama_dir, tmp_path, caplog):
    """After _build_graph and `del model`, nothing keeps the model's weights (here: the mapping of
    its safetensors file) or the traced FX graph alive, and the traced model is on the meta device."""
    caplog.set_level(logging.WARNING)  # pytest keeps INFO records, whose args hold the exporter's graph
    src = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, src)  # a file no other test has loaded
    model = load_model(str(src)).model.float().eval()
    model(torch.tensor([[1, 2, 3]]))  # touch the weights, as the parity reference does
    assert _mapped(src / "model.safetensors")
    out = tmp_path / "out"
    out.mkdir()
    earlier = {id(g) for g in _traced_fx_graphs()}  # other tests' exports may still be referenced (tracebacks)
    proto = onnx_exporter._build_graph(model, "fp32", [], out / onnx_exporter.MODEL_FILE)
    assert all(p.is_meta for p in model.parameters())
    del model, proto
    gc.collect()
    assert not _mapped(src / "model.safetensors")
    assert not [g for g in _traced_fx_graphs() if id(g) not in earlier]  # torch.export's and onnxscript's leftovers


def _traced_fx_graphs() -> list:
    """FX graphs of a traced decoder still alive (torch.export names the lifted embedding so)."""
    return [g for g in gc.get_objects() if isinstance(g, torch.fx.Graph)
            and any(n.name == "p_model_model_embed_tokens_weight" for n in g.nodes)]


def test_release_weights_drops_initializers():
    import onnx_ir as ir

    value = ir.Value(name="w", const_value=ir.tensor(np.ones((4, 4), np.float32)))
    graph = ir.Graph([], [], nodes=[], initializers=[value])
    onnx_graph.release_weights(ir.Model(graph, ir_version=10))
    assert value.const_value is None and not graph.initializers


def test_meta_trace_reads_every_weight_back_from_the_scratch_file(tiny_llama_dir, tmp_path):
    """Traced on meta, the graph's weights are the model's, bit for bit: each linear weight once,
    transposed and named after its module, the tied embedding/head once, and the scratch file gone."""
    from onnx import numpy_helper

    model = load_model(str(tiny_llama_dir)).model.float().eval()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    onnx_graph.trace(model, tmp_path / "model.onnx", "model.onnx_data")
    assert all(p.is_meta for p in model.parameters())
    assert not (tmp_path / onnx_graph.SCRATCH_FILE).exists()
    loaded = onnx.load(str(tmp_path / "model.onnx"))
    inits = {t.name: numpy_helper.to_array(t) for t in loaded.graph.initializer}
    for name in linears:
        assert np.array_equal(inits.pop(f"{name}.weight.T"), weights[f"{name}.weight"].numpy().T), name
    embedding = weights["model.embed_tokens.weight"].numpy()
    same = [n for n, a in inits.items() if a.shape == embedding.shape and np.array_equal(a, embedding)]
    assert len(same) == 1  # tied with the head: stored once
    norms = [n for n in weights if n.endswith("norm.weight")]
    assert all(any(np.array_equal(a, weights[n].numpy()) for a in inits.values()) for n in norms)


def test_stream_weights_refuses_an_initializer_it_cannot_place(tmp_path):
    """A traced tensor that is none of the model's parameters or buffers (its values were computed
    on meta, so there are none) stops the export instead of writing garbage."""
    import onnx_ir as ir

    value = ir.Value(name="model.c_lifted_tensor_0", shape=ir.Shape([4]), type=ir.TensorType(ir.DataType.FLOAT))
    graph = ir.Graph([], [], nodes=[], initializers=[value])
    with pytest.raises(RuntimeError, match="none of the model's parameters"):
        onnx_graph.stream_weights(graph, {}, tmp_path / "none")
