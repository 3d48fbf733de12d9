"""fp16 and int8 ONNX exports, and Qwen2 (q/k/v biases, untied head), against PyTorch."""

from __future__ import annotations

import numpy as np
import onnx
import torch

from exporters import onnx as onnx_exporter
from laco_deploy.models import load_model
from laco_deploy.runtimes.onnxrt import OrtDecoder
from laco_deploy.runtimes.parity import onnx_parity


def _decode_diff(folder, model_dir, n_prefill: int = 20, n_decode: int = 6) -> tuple[float, float]:
    """Independent of the export's own check: max |logit diff| and top-1 agreement over a prefill
    and teacher-forced decode steps, against the fp32 PyTorch model."""
    model = load_model(str(model_dir)).model
    ids = torch.randint(3, 500, (n_prefill + n_decode,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = model(ids.view(1, -1)).logits[0].numpy()
    decoder = OrtDecoder(folder)
    logits, past = decoder.prefill(ids[:n_prefill].numpy())
    rows = [logits]
    for pos in range(n_prefill, ids.numel()):
        step, past = decoder.step(int(ids[pos]), pos, past)
        rows.append(step[None])
    got = np.concatenate(rows)
    return float(np.abs(got - ref).max()), float((got.argmax(-1) == ref.argmax(-1)).mean())


def test_fp16_export(tiny_llama_untied_dir, tmp_path):
    result = onnx_exporter.export(tiny_llama_untied_dir, tmp_path / "fp16", "fp16", check=onnx_parity)
    model = onnx.load(str(tmp_path / "fp16" / "model.onnx"))
    weights = [t for t in model.graph.initializer if len(t.dims) == 2]
    assert weights and all(t.data_type == onnx.TensorProto.FLOAT16 for t in weights)
    past = next(i for i in model.graph.input if i.name == "past_key_values.0.key")
    assert past.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    assert OrtDecoder(tmp_path / "fp16").kv_dtype == np.float16
    p = result.checks["parity"]
    # looser than fp32: half-precision weights and activations; typical here ~3e-3
    assert 0 < p["max_abs_logit_diff"] <= 5e-2 and p["top1_agreement"] >= 0.97
    max_diff, top1 = _decode_diff(tmp_path / "fp16", tiny_llama_untied_dir)
    assert 0 < max_diff <= 5e-2 and top1 >= 0.9
    fp32_weight_bytes = sum(p.numel() * 4 for p in load_model(str(tiny_llama_untied_dir)).model.parameters())
    assert result.size_bytes < 0.6 * fp32_weight_bytes + 200_000
    assert result.checks["genai"]["checked"]  # genai ran the fp16 folder end to end (tokens vs fp32 PyTorch may differ)


def test_int8_export_via_cli(cli, tiny_llama_untied_dir, tmp_path):
    out = tmp_path / "int8"
    code, stdout, err = cli("export", "--model", tiny_llama_untied_dir, "--target", "onnx", "--quant", "int8", "--out", out)
    assert code == 0, err
    flat = " ".join(stdout.split())  # the console wraps at 80 columns wherever the path length puts the break
    assert "onnx int8" in flat and "max_abs_logit_diff" in flat
    model = onnx.load(str(out / "model.onnx"))
    nbits = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    assert len(nbits) == 2 * 7 + 1  # every linear of both layers, and the untied head
    attrs = {a.name: a.i for a in nbits[0].attribute}
    assert attrs["bits"] == 8 and attrs["block_size"] == onnx_exporter.INT8_BLOCK and attrs["accuracy_level"] == 4
    assert not any(n.op_type == "MatMul" and "proj" in "".join(n.input) for n in model.graph.node)
    max_diff, top1 = _decode_diff(out, tiny_llama_untied_dir)
    # 8-bit weights and per-block int8 activations: looser than fp32, still close
    assert 1e-4 < max_diff <= 0.2 and top1 >= 0.9
