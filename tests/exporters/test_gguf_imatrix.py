"""Importance matrices: computed as llama-imatrix defines them, written in llama.cpp's format, read back by
our reader and by llama.cpp's own `llama-quantize --imatrix`, and used by llama.cpp's quantizer."""

from __future__ import annotations

import struct
import subprocess

import gguf
import numpy as np
import pytest
import torch

import tiny
from exporters import gguf_imatrix
from laco_deploy.config import DataConfig
from laco_deploy.errors import ExportError

pytest.importorskip("llama_cpp")
from exporters import llama_tools  # noqa: E402
from exporters.gguf import export  # noqa: E402
from laco_deploy.imatrix import compute  # noqa: E402

DATA = DataConfig(samples=4, seqlen=32)


@pytest.fixture(scope="module")
def wide_llama_dir(tmp_path_factory, bpe_tokenizer):
    """2-layer Llama, hidden 256 / FFN 512: rows fill whole k-quant blocks, so Q4_K itself is used."""
    return tiny.save_tiny(tiny.build_model(tiny.llama_config(hidden=256), seed=4), bpe_tokenizer,
                          tmp_path_factory.mktemp("wide_llama"))


@pytest.fixture(scope="module")
def wide_imatrix(wide_llama_dir, tmp_path_factory):
    return compute(wide_llama_dir, DATA, tmp_path_factory.mktemp("imat") / "wide.imatrix.gguf")


def test_write_read_round_trip_and_llama_cpp_layout(tmp_path):
    sums = {"blk.1.ffn_down.weight": np.arange(8, dtype=np.float32), "blk.0.attn_q.weight": np.full(4, 6.0, np.float32)}
    gguf_imatrix.write(tmp_path / "m.gguf", sums, {"blk.1.ffn_down.weight": 4, "blk.0.attn_q.weight": 3},
                       datasets=["builtin"], chunk_count=7, chunk_size=32, arch="llama")
    reader = gguf.GGUFReader(str(tmp_path / "m.gguf"))
    assert reader.get_field("general.type").contents() == "imatrix"
    assert reader.get_field("imatrix.chunk_count").contents() == 7 and reader.get_field("imatrix.chunk_size").contents() == 32
    assert [t.name for t in reader.tensors] == ["blk.0.attn_q.weight.in_sum2", "blk.0.attn_q.weight.counts",
                                                "blk.1.ffn_down.weight.in_sum2", "blk.1.ffn_down.weight.counts"]
    t = {t.name: t for t in reader.tensors}
    assert list(t["blk.1.ffn_down.weight.in_sum2"].shape) == [8, 1] and list(t["blk.1.ffn_down.weight.counts"].shape) == [1, 1]
    back = gguf_imatrix.read(tmp_path / "m.gguf")
    np.testing.assert_allclose(back.values["blk.1.ffn_down.weight"], np.arange(8) / 4)
    np.testing.assert_allclose(back.values["blk.0.attn_q.weight"], np.full(4, 2.0))
    assert (back.datasets, back.chunk_count, back.chunk_size) == (("builtin",), 7, 32)


def test_legacy_dat_is_read_as_llama_cpp_does(tmp_path):
    """Legacy values are mean * ncall; the quantizer divides by ncall."""
    name = b"blk.0.ffn_up.weight"
    blob = struct.pack("<i", 1) + struct.pack("<i", len(name)) + name + struct.pack("<ii", 5, 3)
    blob += struct.pack("<3f", 5.0, 10.0, 0.5) + struct.pack("<ii", 9, 4) + b"wiki"
    (tmp_path / "old.dat").write_bytes(blob)
    back = gguf_imatrix.read(tmp_path / "old.dat")
    np.testing.assert_allclose(back.values["blk.0.ffn_up.weight"], [1.0, 2.0, 0.1], rtol=1e-6)
    assert back.datasets == ("wiki",) and back.chunk_count == 9
    (tmp_path / "bad.dat").write_bytes(blob[:20])
    with pytest.raises(ExportError, match="truncated"):
        gguf_imatrix.read(tmp_path / "bad.dat")


def test_values_are_mean_squared_inputs_of_a_plain_forward(wide_llama_dir, wide_imatrix):
    """Against hooks on an ordinary Hugging Face forward pass (not the layer engine) over the same samples."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from laco_deploy.data import calibration_samples

    model = AutoModelForCausalLM.from_pretrained(wide_llama_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(wide_llama_dir)
    ids = calibration_samples(tok, DATA.calib, DATA.samples, DATA.seqlen, DATA.seed)
    seen: dict[str, list[torch.Tensor]] = {}
    hooks = [m.register_forward_hook(lambda m, a, o, n=n: seen.setdefault(n, []).append(a[0].reshape(-1, a[0].shape[-1])))
             for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    got = gguf_imatrix.read(wide_imatrix.path).values
    assert wide_imatrix.entries == len(got) == 14  # 7 linears x 2 layers; no LM head, no embeddings
    gguf_name = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down"}
    for name, xs in seen.items():
        layer, short = name.split(".")[2], name.split(".", 3)[3]
        want = torch.cat(xs).double().pow(2).mean(0).numpy()
        np.testing.assert_allclose(got[f"blk.{layer}.{gguf_name[short]}.weight"], want, rtol=1e-4, atol=1e-7)


def _dequantized(path) -> dict[str, np.ndarray]:
    return {t.name: gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1, t.shape[0])
            for t in gguf.GGUFReader(str(path)).tensors}


def _weighted_error(w: np.ndarray, q: np.ndarray, imp: np.ndarray) -> float:
    return float(((w - q) ** 2 * imp[None, :]).sum())


def test_llama_cpp_quantizer_uses_it(wide_llama_dir, wide_imatrix, tmp_path):
    """With the importance matrix, llama.cpp's Q4_K weights change, and the importance-weighted rounding
    error of each weighted matrix drops (what the quantizer minimizes when given the matrix)."""
    ref = _dequantized(export(wide_llama_dir, tmp_path / "m.f32.gguf", "f32").path)
    plain = _dequantized(export(wide_llama_dir, tmp_path / "m.q4_k_m.gguf", "q4_k_m").path)
    res = export(wide_llama_dir, tmp_path / "i.q4_k_m.gguf", "q4_k_m", imatrix=wide_imatrix.path)
    weighted = _dequantized(res.path)
    imp = gguf_imatrix.read(wide_imatrix.path).values
    assert any("14 weights importance-weighted" in n for n in res.notes), res.notes
    reader = gguf.GGUFReader(res.path)
    assert reader.get_field("laco_deploy.imatrix.entries").contents() == 14
    np.testing.assert_array_equal(weighted["token_embd.weight"], plain["token_embd.weight"])  # no entry: unweighted
    for name, v in imp.items():
        assert not np.array_equal(weighted[name], plain[name]), name
        assert _weighted_error(ref[name], weighted[name], v) < _weighted_error(ref[name], plain[name], v), name


def test_wrong_model_or_type_is_refused_or_noted(wide_llama_dir, tiny_llama_dir, wide_imatrix, tmp_path):
    with pytest.raises(ExportError, match="256 values but the model's tensor has 64 input columns"):
        export(tiny_llama_dir, tmp_path / "t.q4_k_m.gguf", "q4_k_m", imatrix=wide_imatrix.path)
    other = tmp_path / "other.gguf"
    gguf_imatrix.write(other, {"blk.0.nothing.weight": np.ones(4)}, {"blk.0.nothing.weight": 1}, datasets=[],
                       chunk_count=1, chunk_size=1, arch="llama")
    with pytest.raises(ExportError, match="names none of"):
        export(wide_llama_dir, tmp_path / "o.q4_k_m.gguf", "q4_k_m", imatrix=other)
    res = export(wide_llama_dir, tmp_path / "w.q8_0.gguf", "q8_0", imatrix=wide_imatrix.path)
    assert any("unused: q8_0" in n for n in res.notes)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.gguf", "w.q8_0.gguf"]


def test_old_binding_is_a_clear_error():
    class Old:
        __version__ = "0.3.8"

    with pytest.raises(ExportError, match="llama-cpp-python 0.3.8 cannot pass an importance matrix"):
        gguf_imatrix.ctypes_entries(Old, gguf_imatrix.Imatrix({"a": np.ones(2, np.float32)}))


def test_llama_quantize_reads_our_file_like_we_do(wide_llama_dir, wide_imatrix, tmp_path):
    """Round trip through llama.cpp's own reader: `llama-quantize --imatrix OUR_FILE` writes the same
    tensors as our export passing the values we read (and not those of a plain quantization)."""
    tool = llama_tools.find_quantize()
    if tool is None:
        pytest.skip(f"llama-quantize not built ({llama_tools.quantize_path()}); build it: python -m exporters.llama_tools")
    f32 = export(wide_llama_dir, tmp_path / "m.f32.gguf", "f32").path
    ours = export(wide_llama_dir, tmp_path / "ours.q4_k_m.gguf", "q4_k_m", imatrix=wide_imatrix.path).path
    for name, extra in (("theirs", ["--imatrix", wide_imatrix.path]), ("plain", [])):
        run = subprocess.run([str(tool), *map(str, extra), f32, str(tmp_path / f"{name}.gguf"), "Q4_K_M", "1"],
                             capture_output=True, text=True)
        assert run.returncode == 0, run.stderr[-2000:]
    assert "loaded 14 importance matrix entries" in subprocess.run(
        [str(tool), "--imatrix", wide_imatrix.path, f32, str(tmp_path / "again.gguf"), "Q4_K_M", "1"],
        capture_output=True, text=True).stdout
    ours_t = {t.name: t for t in gguf.GGUFReader(ours).tensors}
    theirs_t = {t.name: t for t in gguf.GGUFReader(str(tmp_path / "theirs.gguf")).tensors}
    plain_t = {t.name: t for t in gguf.GGUFReader(str(tmp_path / "plain.gguf")).tensors}
    assert set(ours_t) == set(theirs_t)
    for name, t in ours_t.items():
        assert t.tensor_type == theirs_t[name].tensor_type, name
        np.testing.assert_array_equal(np.asarray(t.data), np.asarray(theirs_t[name].data), err_msg=name)
    assert not np.array_equal(np.asarray(ours_t["blk.0.ffn_up.weight"].data), np.asarray(plain_t["blk.0.ffn_up.weight"].data))


def test_cli_imatrix_then_export(cli, wide_llama_dir, tmp_path):
    code, out, err = cli("imatrix", "--model", wide_llama_dir, "--out", tmp_path / "x.gguf", "--samples", "2",
                         "--seqlen", "16", "--device", "cpu")
    assert code == 0, err
    assert "14 weight matrices, 2 x 16 tokens" in " ".join(out.split())  # the console wraps lines
    code, out, err = cli("export", "--model", wide_llama_dir, "--quant", "q3_k_m", "--imatrix", tmp_path / "x.gguf",
                         "--out", tmp_path / "x.q3_k_m.gguf")
    assert code == 0, err
    assert "14 weights importance-weighted" in " ".join(out.split())
    code, _, err = cli("export", "--model", wide_llama_dir, "--target", "onnx", "--imatrix", tmp_path / "x.gguf",
                       "--out", tmp_path / "o")
    assert code == 2 and "--imatrix" in err



def test_quantize_tool_location_and_missing_cmake(cache_dir, monkeypatch, tmp_path):
    import llama_cpp

    monkeypatch.delenv(llama_tools.ENV, raising=False)
    assert llama_tools.quantize_path() == cache_dir / f"llama.cpp-{llama_cpp.__version__}" / "llama-quantize"
    assert llama_tools.find_quantize() is None
    fake = tmp_path / "llama-quantize"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv(llama_tools.ENV, str(fake))
    assert llama_tools.find_quantize() == fake
    monkeypatch.setattr(llama_tools.shutil, "which", lambda _name: None)
    with pytest.raises(ExportError, match="needs cmake"):
        llama_tools.build_quantize()


def test_structured_model_gets_its_own_widths(wide_llama_dir, wide_imatrix, tmp_path):
    """Per-layer widths (written as deci): each entry has its layer's input width, and the dense
    model's matrix is refused by the pruned one."""
    from laco_deploy.models import load_model
    from laco_deploy.structured import WIDTHS_KEY, shrink_layer

    widths = [{"intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2},
              {"intermediate_size": 512, "num_attention_heads": 2, "num_key_value_heads": 1}]
    loaded = load_model(str(wide_llama_dir))
    for layer, w in zip(loaded.model.model.layers, widths):
        old = {n: m.weight.detach().clone() for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}
        shrink_layer(layer, w, 64)
        with torch.no_grad():
            for n, m in layer.named_modules():
                if isinstance(m, torch.nn.Linear):
                    m.weight.copy_(old[n][: m.weight.shape[0], : m.weight.shape[1]])
    setattr(loaded.model.config, WIDTHS_KEY, widths)
    src = tmp_path / "structured"
    loaded.model.save_pretrained(src, safe_serialization=True)
    loaded.tokenizer.save_pretrained(src)
    res = compute(src, DATA, tmp_path / "s.imatrix.gguf")
    values = gguf_imatrix.read(res.path).values
    assert values["blk.0.ffn_down.weight"].size == 256 and values["blk.1.ffn_down.weight"].size == 512
    assert values["blk.1.attn_output.weight"].size == 128 and values["blk.1.attn_q.weight"].size == 256
    out = export(src, tmp_path / "s.q4_k_m.gguf", "q4_k_m", imatrix=res.path)
    assert out.checks["architecture"] == "deci" and any("14 weights importance-weighted" in n for n in out.notes)
    with pytest.raises(ExportError, match="blk.0.ffn_down.weight has 512 values but the model's tensor has 256"):
        export(src, tmp_path / "d.q4_k_m.gguf", "q4_k_m", imatrix=wide_imatrix.path)


@pytest.mark.parametrize("quant", ["q3_k_m", "q2_k"])
def test_ggml_row_quantizer_reproduces_the_export(wide_llama_dir, wide_imatrix, tmp_path, quant):
    """llama.cpp's row quantizer through ctypes gives the exported bytes of every quantized tensor, with the
    importance matrix where it has an entry: the exact quantizer a quantization-aware step can train through."""
    from exporters import ggml_quants, gguf_model

    path = export(wide_llama_dir, tmp_path / f"m.{quant}.gguf", quant, imatrix=wide_imatrix.path).path
    imp = gguf_imatrix.read(wide_imatrix.path).values
    plan = gguf_model.plan_model(gguf_model.read_config(wide_llama_dir))
    entries = {e.name: e for e in gguf_model.tensor_entries(wide_llama_dir, plan)}
    checked = 0
    for t in gguf.GGUFReader(str(path)).tensors:
        if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            continue
        w = gguf_model.read_tensor(entries[t.name])
        assert ggml_quants.quantize(w, t.tensor_type, imp.get(t.name)) == np.asarray(t.data).tobytes(), t.name
        checked += 1
    assert checked == 15  # 14 weighted matrices and the embeddings
    w = gguf_model.read_tensor(entries["blk.0.ffn_up.weight"])
    q = ggml_quants.fake_quantize(w, gguf.GGMLQuantizationType.Q3_K, imp["blk.0.ffn_up.weight"])
    assert q.shape == w.shape and 0 < np.abs(q - w).max() < np.abs(w).max()


def test_cli_export_takes_the_matrix_a_qa_model_trained_through(cli, wide_llama_dir, wide_imatrix, tmp_path):
    """`export --imatrix calib` of a folder holding QA-LaCo's imatrix.gguf quantizes with that file (the
    same bytes as naming it), not a matrix computed on the model; without --imatrix it says so."""
    import shutil

    model = tmp_path / "qa"
    shutil.copytree(wide_llama_dir, model)
    shutil.copyfile(wide_imatrix.path, model / "imatrix.gguf")
    code, out, err = cli("export", "--model", model, "--quant", "q2_k", "--imatrix", "calib", "--out", tmp_path / "a.gguf")
    assert code == 0, err
    assert "trained qa through" in " ".join(out.split()) and not (tmp_path / "a.imatrix.gguf").exists()
    code, _, err = cli("export", "--model", model, "--quant", "q2_k", "--imatrix", wide_imatrix.path, "--out", tmp_path / "b.gguf")
    assert code == 0, err
    a, b = (gguf.GGUFReader(str(tmp_path / f"{n}.gguf")).tensors for n in "ab")
    assert all(np.array_equal(np.asarray(x.data), np.asarray(y.data)) for x, y in zip(a, b))
    code, out, err = cli("export", "--model", model, "--quant", "q2_k", "--out", tmp_path / "c.gguf")
    assert code == 0 and "without --imatrix calib" in " ".join(out.split()), err
