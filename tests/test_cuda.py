"""CUDA paths of the layer engine: skipped without a GPU, run by benchmarks/gpu_check.py on one.

The same tiny-model jobs as on CPU, on `cuda`: masks chosen on the GPU agree with the CPU's,
LaCo trains under autocast and keeps the mask, and the memory reported is CUDA's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from laco_deploy.data import builtin_path

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def calib(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cuda_calib") / "calib.txt"
    path.write_text(builtin_path("calib").read_text(encoding="utf-8")[:20_000], encoding="utf-8")
    return path


def _weights(d: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def test_auto_device_is_cuda():
    from laco_deploy.models import resolve_device

    assert resolve_device("auto").type == "cuda"


def test_wanda_masks_on_cuda_match_cpu(cli, tiny_llama_dir, calib, tmp_path):
    common = ["prune", "--model", tiny_llama_dir, "--method", "wanda", "--calib", calib, "--samples", 4, "--seqlen", 32]
    for dev in ("cpu", "cuda"):
        code, _out, err = cli(*common, "--device", dev, "--out", tmp_path / dev)
        assert code == 0, err
    a, b = _weights(tmp_path / "cpu"), _weights(tmp_path / "cuda")
    differ = sum(int(((a[k] == 0) != (b[k] == 0)).sum()) for k in a)
    total = sum(a[k].numel() for k in a)
    assert differ <= 1e-3 * total  # float sums on the GPU may break near-ties differently


def test_laco_on_cuda_trains_under_the_mask(cli, tiny_llama_dir, calib, tmp_path):
    code, _out, err = cli("prune", "--model", tiny_llama_dir, "--calib", calib, "--samples", 4, "--seqlen", 32,
                          "--device", "cuda", "--out", tmp_path / "pruned")
    assert code == 0, err
    code, _out, err = cli("compensate", "--dense", tiny_llama_dir, "--sparse", tmp_path / "pruned", "--calib", calib,
                         "--samples", 8, "--seqlen", 32, "--epochs", 2, "--val-fraction", 0, "--device", "cuda",
                         "--json", tmp_path / "laco.json", "--out", tmp_path / "laco")
    assert code == 0, err
    result = json.loads((tmp_path / "laco.json").read_text())
    assert result["memory_kind"] == "cuda_max_allocated" and result["peak_mib"] > 0
    pruned, laco = _weights(tmp_path / "pruned"), _weights(tmp_path / "laco")
    assert all(torch.equal(pruned[k] == 0, laco[k] == 0) for k in pruned)
    assert any(not torch.equal(pruned[k], laco[k]) for k in pruned)
