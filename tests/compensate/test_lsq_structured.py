"""--init lsq on structured (width-pruned) models: down_proj and o_proj are refit in closed form
from the smaller layer's activations, the linears that lost output rows keep their weights."""

from __future__ import annotations

import pytest
import torch
from test_laco import DATA, _cfg, _weights

from laco_deploy.compensate import run
from laco_deploy.config import DataConfig, ModelConfig, PruneConfig


@pytest.fixture(scope="module")
def heads_and_ffn_dir(tiny_llama_dir, tmp_path_factory):
    """Structured 50%: half of the FFN channels and one of the two KV head groups removed per layer."""
    from laco_deploy.prune import run as prune

    out = tmp_path_factory.mktemp("structured") / "s50"
    prune(ModelConfig(model=str(tiny_llama_dir)), DataConfig(calib="builtin", samples=8, seqlen=32), PruneConfig(structured=0.5), out,
          device=torch.device("cpu"))
    return out


def test_refit_keeps_shapes_and_lowers_the_layer_error(tiny_llama_dir, heads_and_ffn_dir, tmp_path):
    res = run(ModelConfig(model=str(tiny_llama_dir)), DATA, _cfg(epochs=0, init="lsq"), heads_and_ffn_dir, tmp_path / "out")
    for rec in res.per_layer:  # epochs 0: the closed-form start alone, kept because it lowers the held-out error
        assert rec["nmse_after"] < 0.95 * rec["nmse_pruned"]
    before, after = _weights(heads_and_ffn_dir), _weights(tmp_path / "out")
    assert before.keys() == after.keys()
    for k in before:
        assert before[k].shape == after[k].shape, k
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            assert not torch.equal(before[k], after[k]), k
        else:  # q/k/v and gate/up lost output rows: no dense target, weights as pruned
            assert torch.equal(before[k], after[k]), k


def test_refit_then_training_beats_training_alone(tiny_llama_dir, heads_and_ffn_dir, tmp_path):
    mcfg = ModelConfig(model=str(tiny_llama_dir))
    plain = run(mcfg, DATA, _cfg(epochs=3), heads_and_ffn_dir, tmp_path / "plain")
    warm = run(mcfg, DATA, _cfg(epochs=3, init="lsq"), heads_and_ffn_dir, tmp_path / "warm")
    assert warm.per_layer[0]["nmse_after"] < plain.per_layer[0]["nmse_after"]  # layer 0: same inputs in both runs


def test_supervised_linears_of_an_ffn_only_model(tiny_llama_dir, sparse_structured_dir):
    from laco_deploy.compensate.lsq import supervised
    from laco_deploy.engine import LayerContext
    from laco_deploy.models import load_model

    dense, sparse = load_model(str(tiny_llama_dir)), load_model(str(sparse_structured_dir))
    ctx = LayerContext(0, 2, sparse.model.model.layers[0], None, {}, torch.device("cpu"), 4,
                       dense.model.model.layers[0])
    names = [f"self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj", "o_proj")] + \
            [f"mlp.{n}" for n in ("gate_proj", "up_proj", "down_proj")]
    assert supervised(ctx, names) == [n for n in names if n not in ("mlp.gate_proj", "mlp.up_proj")]
