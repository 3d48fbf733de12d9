"""Sparse storage: bitmask packing (pure), and an export round trip with the same logits."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

from exporters import onnx as onnx_exporter
from exporters import onnx_sparse
from laco_deploy.models import load_model, save_model
from laco_deploy.runtimes.onnxrt import OrtDecoder, OrtRunner
from laco_deploy.runtimes.parity import onnx_parity


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int8])
def test_pack_unpack_round_trip(dtype):
    rng = np.random.default_rng(0)
    dense = (rng.normal(size=(37, 19)) * 50).astype(dtype)
    dense[rng.random(dense.shape) < 0.6] = 0
    values, mask = onnx_sparse.pack(dense)
    assert values.dtype == dense.dtype and values.size == np.count_nonzero(dense)
    assert mask.dtype == np.uint8 and mask.size == -(-dense.size // 8)
    assert np.array_equal(onnx_sparse.unpack(values, mask, dense.shape), dense)


def test_fill_value_of_8bit_codes():
    """8-bit MatMulNBits codes hold a pruned weight as 128; floats as 0."""
    rng = np.random.default_rng(1)
    codes = np.full((8, 4, 32), 128, np.uint8)
    keep = rng.random(codes.shape) < 0.5
    codes[keep] = rng.integers(0, 128, int(keep.sum()))  # any code but 128
    assert onnx_sparse.fill_value(codes) == 128
    values, mask = onnx_sparse.pack(codes, 128)
    assert values.size == np.count_nonzero(codes != 128)
    assert np.array_equal(onnx_sparse.unpack(values, mask, codes.shape, 128), codes)
    assert onnx_sparse.fill_value(np.ones((3, 3), np.float32)) == 0.0


def test_packed_size_formula():
    # 50% sparse fp32 matrix of 1024 x 1024: half the values (2 MiB) plus one bit each (128 KiB)
    assert onnx_sparse.packed_bytes(1024 * 1024, 512 * 1024, 4) == 2 * 2**20 + 2**17
    # int8 at 2:4 (50%): 0.5 + 0.125 bytes per weight
    assert onnx_sparse.packed_bytes(800, 400, 1) == 400 + 100


def test_corrupt_mask_is_reported():
    values, mask = onnx_sparse.pack(np.array([[1.0, 0.0], [0.0, 2.0]], np.float32))
    with pytest.raises(Exception, match="corrupt"):
        onnx_sparse.unpack(values[:1], mask, (2, 2))


@pytest.fixture(scope="module")
def pruned_dir(tiny_llama_dir, tmp_path_factory):
    """The tiny Llama with half of every linear's weights (smallest per row) set to zero."""
    loaded = load_model(str(tiny_llama_dir))
    with torch.no_grad():
        for name, mod in loaded.model.named_modules():
            if isinstance(mod, torch.nn.Linear) and "lm_head" not in name:
                idx = mod.weight.abs().argsort(dim=1)[:, : mod.weight.shape[1] // 2]
                mod.weight.scatter_(1, idx, 0.0)
    out = tmp_path_factory.mktemp("pruned") / "model"
    save_model(loaded.model, loaded.tokenizer, out)
    return out


@pytest.fixture(scope="module")
def sparse_export(pruned_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("onnx") / "sparse"
    return onnx_exporter.export(pruned_dir, out, "fp32", sparse_storage=True, check=onnx_parity), out


def test_sparse_export_is_smaller_and_reported(sparse_export):
    result, out = sparse_export
    storage = result.checks["storage"]
    assert storage["tensors_compressed"] == 14 and storage["zero_fraction"] == pytest.approx(0.5, abs=0.01)
    assert storage["sparse_bytes"] == result.size_bytes
    files = sum((out / n).stat().st_size for n in ("model.onnx", "model.onnx_data", onnx_sparse.SPARSE_FILE))
    assert result.size_bytes == files
    assert storage["sparse_bytes"] < 0.8 * storage["dense_bytes"]  # weights are ~2/3 of this tiny file
    assert storage["onnx_checker_densified"] == "passed"
    assert not (out / onnx_sparse.DENSE_FILE).exists()
    assert any("densifies" in n and "no speed-up" in n for n in result.notes)


def test_sparse_round_trip_same_logits(sparse_export, pruned_dir):
    result, out = sparse_export
    assert result.checks["parity"]["max_abs_logit_diff"] <= 1e-3 and result.checks["parity"]["top1_agreement"] >= 0.999
    ids = torch.randint(0, 512, (30,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = load_model(str(pruned_dir)).model(ids.view(1, -1)).logits[0]
    got = OrtRunner(out).logits(ids)
    assert (got - ref).abs().max() <= 1e-4


def test_densify_makes_a_standard_onnx_folder(sparse_export, tmp_path):
    import shutil

    _, src = sparse_export
    out = tmp_path / "copy"
    shutil.copytree(src, out)
    ids = np.arange(5, 25, dtype=np.int64)
    injected = OrtRunner(out).logits(ids).numpy()
    with pytest.raises(Exception, match="densified.bin"):  # plain onnxruntime cannot open it before densify
        ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    written = onnx_sparse.densify(out)
    assert written.name == onnx_sparse.DENSE_FILE and not onnx_sparse.needs_densify(out)
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    decoder = OrtDecoder(out)
    feed = {"input_ids": ids[None], "attention_mask": np.ones((1, 20), np.int64), "position_ids": np.arange(20)[None]}
    feed.update({n: np.zeros((1, 2, 0, 16), np.float32) for n in decoder.past_names})
    plain = session.run(["logits"], feed)[0][0]
    assert np.array_equal(plain, injected)


def test_densify_refuses_a_dense_export(tmp_path):
    from laco_deploy.errors import ExportError

    tmp_path.joinpath("model.onnx").write_bytes(b"")
    with pytest.raises(ExportError, match="export.sparse_storage"):
        onnx_sparse.densify(tmp_path)


def test_int8_sparse_storage(pruned_dir, tmp_path):
    """Pruned weights survive 8-bit quantization as code 128 and compress the same way."""
    result = onnx_exporter.export(pruned_dir, tmp_path / "int8", "int8", sparse_storage=True, check=onnx_parity)
    storage = result.checks["storage"]
    assert storage["tensors_compressed"] == 14 and storage["zero_fraction"] == pytest.approx(0.5, abs=0.02)
    assert storage["sparse_bytes"] < storage["dense_bytes"]
    assert result.checks["parity"]["top1_agreement"] >= 0.9
    ids = torch.arange(3, 40)
    with torch.no_grad():
        ref = load_model(str(pruned_dir)).model(ids.view(1, -1)).logits[0]
    assert (OrtRunner(tmp_path / "int8").logits(ids) - ref).abs().max() <= 0.2
