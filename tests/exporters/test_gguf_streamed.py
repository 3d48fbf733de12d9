"""The streamed GGUF export (tensors read, quantized and written one at a time) equals the in-RAM
export (every tensor quantized and held by the writer, then written at once) byte for byte."""

from __future__ import annotations

import gguf
import pytest
import tiny

from exporters import gguf as mod
from exporters import gguf_model
from exporters.gguf_names import F32_SUFFIXES


def _write_tensors_in_ram(writer, model_dir, plan, config, qtype) -> list[str]:
    """The export before streaming: gguf's add_tensor for every tensor, then write_tensors_to_file."""
    fallbacks = []
    for name, data in [*gguf_model.extra_tensors(plan, config), *gguf_model.iter_tensors(model_dir, plan)]:
        ttype = qtype
        if data.ndim <= 1 or name.endswith(F32_SUFFIXES):
            ttype = gguf.GGMLQuantizationType.F32
        try:
            packed = gguf.quants.quantize(data, ttype)
        except gguf.QuantError:
            ttype = gguf.GGMLQuantizationType.F16
            packed = gguf.quants.quantize(data, ttype)
            fallbacks.append(name)
        writer.add_tensor(name, packed, raw_dtype=ttype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    return fallbacks


@pytest.fixture(scope="module")
def odd_width_dir(tmp_path_factory, bpe_tokenizer):
    """Hidden 48: rows of 48 fit no Q8_0 block of 32, so those tensors fall back to F16."""
    return tiny.save_tiny(tiny.build_model(tiny.llama_config(hidden=48), seed=4), bpe_tokenizer,
                          tmp_path_factory.mktemp("odd_width"))


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_llama_untied_dir", "tiny_qwen2_dir", "odd_width_dir"])
@pytest.mark.parametrize("quant", ["f32", "f16", "bf16", "q8_0"])
def test_streamed_export_equals_in_ram_export(request, fixture, quant, tmp_path, monkeypatch):
    src = request.getfixturevalue(fixture)
    streamed = mod.export(src, tmp_path / "streamed.gguf", quant)
    monkeypatch.setattr(mod, "_write_tensors", _write_tensors_in_ram)
    in_ram = mod.export(src, tmp_path / "in_ram.gguf", quant)
    assert (tmp_path / "streamed.gguf").read_bytes() == (tmp_path / "in_ram.gguf").read_bytes()
    assert streamed.notes == in_ram.notes
    if fixture == "odd_width_dir" and quant == "q8_0":
        assert any("written as F16" in n for n in streamed.notes)
