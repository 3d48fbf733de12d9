"""The GGUF -> safetensors conversion writes what transformers' own GGUF loading builds, bit for bit,
one tensor at a time (laco_deploy/gguf_convert.py)."""

from __future__ import annotations

import json

import pytest
import torch

from laco_deploy import gguf_convert
from laco_deploy.engine.lazy import read_tensors


@pytest.mark.parametrize("fixture, quant", [("tiny_llama_dir", "q8_0"), ("tiny_gemma3_dir", "q8_0"),
                                            ("tiny_llama_dir", "f16")])
def test_streamed_conversion_equals_transformers_loading(fixture, quant, request, tmp_path, monkeypatch):
    """Llama's Q/K rows and Gemma's (1 + w) norms go through transformers' own tensor processors; a
    large tensor is dequantized in row blocks and the tensors spread over several shards (both made
    small here so the tiny model takes those paths)."""
    from exporters.gguf import export
    from transformers import AutoModelForCausalLM

    gguf = tmp_path / f"m.{quant}.gguf"
    export(request.getfixturevalue(fixture), gguf, quant)
    monkeypatch.setattr(gguf_convert, "DEQUANT_BLOCK_BYTES", 512)
    monkeypatch.setattr(gguf_convert, "SHARD_BYTES", 64 * 1024)
    gguf_convert.teach_gguf_reader()
    config = gguf_convert.gguf_config(gguf)
    out = tmp_path / "converted"
    out.mkdir()
    total = gguf_convert.write_gguf_weights(gguf, config, out)

    got = {}
    for shard in sorted(out.glob("*.safetensors")):
        got.update(read_tensors(shard))
    index = json.loads((out / gguf_convert.INDEX).read_text())
    assert len(set(index["weight_map"].values())) > 1 and set(index["weight_map"]) == set(got)
    assert index["metadata"]["total_size"] == total == sum(t.nbytes for t in got.values())

    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, config=config,
                                                     dtype=torch.float32).state_dict()
    if config.tie_word_embeddings:
        reference.pop("lm_head.weight")
    assert set(got) == set(reference)
    assert all(got[k].dtype == torch.float32 and torch.equal(got[k], reference[k]) for k in reference)
    saved = json.loads((out / "config.json").read_text())
    assert saved["architectures"] == [type(AutoModelForCausalLM.from_config(config)).__name__]
    assert "quantization_config" not in saved


def test_a_matrix_dequantized_in_row_blocks_equals_it_whole(tiny_llama_dir, tmp_path, monkeypatch):
    from exporters.gguf import export
    from gguf import GGUFReader, dequantize

    gguf = tmp_path / "m.q8_0.gguf"
    export(tiny_llama_dir, gguf, "q8_0")
    tensor = next(t for t in GGUFReader(str(gguf), "r").tensors if t.data.ndim == 2 and t.data.shape[0] > 3)
    monkeypatch.setattr(gguf_convert, "DEQUANT_BLOCK_BYTES", tensor.data.nbytes // tensor.data.shape[0] * 3)
    blocks = gguf_convert._dequantize(tensor)  # 3 rows at a time
    assert blocks.shape == (tensor.data.shape[0], tensor.data.shape[1] // 34 * 32)
    assert (blocks == dequantize(tensor.data, tensor.tensor_type)).all()
