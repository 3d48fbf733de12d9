"""The importance-weighted quantizers against llama.cpp itself: each equals ggml_quantize_chunk given
the same importance matrix (the call `export --imatrix` makes through llama_model_quantize), bit for bit."""

from __future__ import annotations

import gguf
import pytest
import torch
from test_kquants_low import _matrix

from laco_deploy.compensate import fakequant, kquants_weighted

T = gguf.GGMLQuantizationType
TYPES = {"q2_k": T.Q2_K, "q3_k": T.Q3_K, "q4_k": T.Q4_K, "q5_k": T.Q5_K, "q6_k": T.Q6_K, "q4_0": T.Q4_0,
         "q5_0": T.Q5_0, "q5_1": T.Q5_1}


def _importance(cols: int) -> torch.Tensor:
    """Log-normal like real mean squared activations (a few columns 100x the rest), every 37th zero."""
    imp = torch.exp(torch.randn(cols, generator=torch.Generator().manual_seed(7)) * 1.5)
    imp[::37] = 0.0
    return imp


@pytest.mark.parametrize("kind", ["pruned", "squared", "wide"])
@pytest.mark.parametrize("scheme", sorted(TYPES))
def test_weighted_quantizer_equals_llama_cpp_bit_for_bit(kind, scheme):
    """64 x 1536 values per case (576-wide rows for the 32-blocks: their sigma is the row's); measured:
    0 differ for every scheme and matrix (and on 128 x 576/1024/1536 of each kind)."""
    ggml_quants = pytest.importorskip("exporters.ggml_quants")
    pytest.importorskip("llama_cpp")
    cols = 1536 if scheme.endswith("_k") else 576
    w, imp = _matrix(kind, 64, cols), _importance(cols)
    ref = ggml_quants.fake_quantize(w.numpy(), TYPES[scheme], imp.numpy())
    mine = kquants_weighted.fake_quantize(w, scheme, imp).numpy()
    assert int((mine != ref).sum()) == 0


def test_weighting_moves_the_grid_toward_important_columns():
    """Not the unweighted grid, and a lower importance-weighted error than it (what llama.cpp's imatrix is for)."""
    w, imp = _matrix("wide", 32, 512), _importance(512)
    for scheme in ("q2_k", "q3_k", "q4_k"):
        weighted = kquants_weighted.fake_quantize(w, scheme, imp)
        plain = fakequant.fake_quantize(w, scheme)
        assert not torch.equal(weighted, plain), scheme
        assert ((weighted - w).square() * imp).sum() < ((plain - w).square() * imp).sum(), scheme
