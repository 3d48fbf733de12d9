"""What the ONNX export holds after tracing (issue 33): neither the traced weights nor the traced
graphs outlive the trace (torch.export and onnxscript keep them in module-level state), and
name_weights hashes weights in slices with the same result as hashing them whole."""

from __future__ import annotations

import gc
import hashlib
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
    its safetensors file) or the traced FX graph alive, and the traced model's parameters are emptied."""
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
    assert all(p.numel() == 0 for p in model.parameters())
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_weight_digest_equals_whole_transposed_hash(dtype):
    w = torch.randn(48, 20).to(dtype)  # [out, in]
    whole = hashlib.sha1(w.t().contiguous().numpy().tobytes()).hexdigest()
    old = onnx_graph.HASH_BYTES
    try:
        onnx_graph.HASH_BYTES = 48 * w.element_size() * 3  # 3 input columns per slice, the last one short
        assert onnx_graph.weight_digest(w) == whole
    finally:
        onnx_graph.HASH_BYTES = old
    assert onnx_graph.weight_digest(w) == whole


def test_initializer_digest_external_and_inline(tmp_path):
    array = np.random.default_rng(0).standard_normal((40, 30)).astype(np.float32)
    whole = hashlib.sha1(array.tobytes()).hexdigest()
    tensor = onnx.numpy_helper.from_array(array, "w")
    assert onnx_graph.initializer_digest(tensor, None) == whole
    graph = onnx.helper.make_graph([], "g", [], [], initializer=[tensor])
    model = onnx.helper.make_model(graph)
    onnx.save_model(model, str(tmp_path / "m.onnx"), save_as_external_data=True, location="m.data", size_threshold=0)
    loaded = onnx.load(str(tmp_path / "m.onnx"), load_external_data=False)
    old = onnx_graph.HASH_BYTES
    try:
        onnx_graph.HASH_BYTES = 1000  # several reads, the last one short
        assert onnx_graph.initializer_digest(loaded.graph.initializer[0], tmp_path) == whole
    finally:
        onnx_graph.HASH_BYTES = old
