"""Fidelity metrics against their formulas on tiny hand-made tensors, and the gate logic."""

from __future__ import annotations

import math

import pytest
import torch

from laco_deploy.config import FidelityConfig
from laco_deploy.divergence import token_kl
from laco_deploy.fidelity import metrics as M
from laco_deploy.fidelity.gates import evaluate_gates, gate_message
from laco_deploy.fidelity.layerwise import LayerCurves, record_layer_outputs


def test_kl_matches_hand_computed_value():
    # p = [0.5, 0.5], q = [0.9, 0.1]: KL = 0.5 ln(0.5/0.9) + 0.5 ln(0.5/0.1)
    dense = torch.log(torch.tensor([[0.5, 0.5]]))
    cand = torch.log(torch.tensor([[0.9, 0.1]]))
    expected = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert token_kl(dense, cand).item() == pytest.approx(expected, abs=1e-7)
    # KL is not symmetric: the reverse direction is a different number
    reverse = 0.9 * math.log(0.9 / 0.5) + 0.1 * math.log(0.1 / 0.5)
    assert token_kl(cand, dense).item() == pytest.approx(reverse, abs=1e-7)


def test_kl_against_formula_on_random_logits_and_chunking():
    gen = torch.Generator().manual_seed(0)
    dense, cand = torch.randn(150, 11, generator=gen), torch.randn(150, 11, generator=gen)  # 150 rows > one chunk
    p, q = torch.softmax(dense.double(), -1), torch.softmax(cand.double(), -1)
    expected = (p * (p / q).log()).sum(-1)
    assert torch.allclose(token_kl(dense, cand), expected, atol=1e-12)
    assert token_kl(dense, dense).abs().max().item() == 0.0
    assert token_kl(dense, dense + 3.0).abs().max().item() < 1e-12  # softmax is shift-invariant


def test_top1_and_top_token_prob_delta():
    dense = torch.log(torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.3, 0.6]]))
    cand = torch.log(torch.tensor([[0.4, 0.5, 0.1], [0.2, 0.2, 0.6]]))
    assert M.top1_agreement(dense, cand).tolist() == [False, True]
    delta = M.top_token_prob_delta(dense, cand)
    assert delta.tolist() == pytest.approx([0.4 - 0.7, 0.6 - 0.6], abs=1e-7)
    # a higher temperature keeps the argmax (top-1 = 1) but lowers the top token's probability
    assert M.top1_agreement(dense, dense / 2).all()
    assert (M.top_token_prob_delta(dense, dense / 2) < 0).all()


def test_next_token_nll_and_perplexity():
    vocab = 5
    ids = torch.tensor([0, 3, 1, 4])
    uniform = torch.zeros(4, vocab)
    nll = M.next_token_nll(uniform, ids)
    assert nll.shape == (3,)
    assert torch.allclose(nll, torch.full((3,), math.log(vocab), dtype=torch.float64))
    assert M.perplexity(nll.sum().item(), nll.numel()) == pytest.approx(vocab)
    # position i is scored on token i+1
    logits = torch.full((4, vocab), -1e4)
    logits[0, 3] = logits[1, 1] = logits[2, 4] = 0.0
    assert M.next_token_nll(logits, ids).abs().max().item() < 1e-6
    with pytest.raises(ValueError):
        M.perplexity(0.0, 0)


def test_relative_error_and_cosine():
    h, ref = torch.tensor([[3.0, 4.0], [1.0, 0.0], [2.0, 2.0]]), torch.tensor([[3.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    assert M.relative_error(h, ref).tolist() == pytest.approx([4 / 3, math.sqrt(2), 1.0])
    assert M.cosine(h, ref).tolist() == pytest.approx([0.6, 0.0, 1.0])
    assert M.relative_error(ref, ref).abs().max().item() == 0.0
    with pytest.raises(ValueError):
        M.cosine(h, ref[:2])


def test_summarize_and_histogram():
    values = torch.arange(1, 101, dtype=torch.float64)
    s = M.summarize(values)
    assert s == pytest.approx({"mean": 50.5, "median": 50.5, "p99": 99.01, "max": 100.0})
    kl = torch.tensor([0.0, 0.0, 1e-7, 1e-3, 0.5, 2.0])
    hist = M.log_histogram(kl, bins=10)
    assert len(hist["edges"]) == len(hist["counts"]) + 1 == 12
    assert sum(hist["counts"]) == 6
    assert hist["counts"][0] == 3  # below the 1e-6 floor
    assert hist["counts"][-1] >= 1 and hist["edges"][-1] == pytest.approx(2.0)  # the max lands in the top bin


def test_gates_pass_fail_miss_and_nan():
    metrics = {"a": {"kl": {"mean": 0.2}, "top1": 0.9, "ppl_ratio": 1.05},
               "b": {"kl": {"mean": 0.5}, "top1": 0.7, "ppl_ratio": float("nan")}}
    gates = evaluate_gates(FidelityConfig(max_kl=0.3, min_top1=0.8, max_ppl_ratio=1.1), metrics)
    by = {(g["name"], g["candidate"]): g for g in gates}
    assert len(gates) == 6
    assert by["max_kl", "a"]["passed"] and by["max_kl", "a"]["miss"] == 0.0
    assert not by["max_kl", "b"]["passed"] and by["max_kl", "b"]["miss"] == pytest.approx(0.2)
    assert not by["min_top1", "b"]["passed"] and by["min_top1", "b"]["miss"] == pytest.approx(0.1)
    assert not by["max_ppl_ratio", "b"]["passed"]  # NaN never passes
    assert "FAILED by 0.2" in gate_message(by["max_kl", "b"]) and "b" in gate_message(by["max_kl", "b"])
    assert evaluate_gates(FidelityConfig(), metrics) == []


def test_config_rejects_bad_gates():
    assert any("fidelity.min_top1 1.5" in e for e in FidelityConfig(min_top1=1.5).validate())
    assert any("fidelity.max_kl" in e for e in FidelityConfig(max_kl=-1).validate())
    assert any("nan" in e for e in FidelityConfig(max_kl=float("nan")).validate())
    assert FidelityConfig(max_kl=0.1, min_top1=0.9, max_ppl_ratio=1.2).validate() == []


def test_layer_curves_average_over_tokens():
    curves = LayerCurves(2)
    ref = [torch.ones(3, 4), torch.ones(3, 4)]
    curves.add([torch.ones(3, 4), 2 * torch.ones(3, 4)], ref)  # layer 1: rel. error 1, cosine 1
    curves.add([torch.ones(1, 4), -torch.ones(1, 4)], [torch.ones(1, 4), torch.ones(1, 4)])  # rel 2, cos -1
    rows = curves.to_list()
    assert rows[0] == {"layer": 0, "rel_error": 0.0, "cosine": pytest.approx(1.0)}
    assert rows[1]["rel_error"] == pytest.approx((3 * 1.0 + 2.0) / 4)
    assert rows[1]["cosine"] == pytest.approx((3 * 1.0 - 1.0) / 4)


def test_recorded_layer_outputs_match_hidden_states():
    import tiny

    model = tiny.build_model(tiny.llama_config(layers=3))
    ids = torch.randint(0, tiny.VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), record_layer_outputs(model) as outs:
        ref = model(ids, output_hidden_states=True, use_cache=False).hidden_states
    assert len(outs) == 3
    for i in range(2):  # hidden_states[i + 1] is the output of layer i, except the last (normed)
        assert torch.equal(outs[i], ref[i + 1])
    with torch.no_grad():
        assert torch.allclose(model.model.norm(outs[2]), ref[3], atol=1e-6)
        model(ids, use_cache=False)
    assert len(outs) == 3  # hooks removed: a later forward records nothing


def test_compare_logits_equals_the_separate_metrics():
    gen = torch.Generator().manual_seed(1)
    dense, cand = torch.randn(150, 37, generator=gen) * 3, torch.randn(150, 37, generator=gen) * 3  # > one row chunk
    ids = torch.randint(0, 37, (150,), generator=gen)
    out = M.compare_logits(dense, cand, ids)
    assert torch.allclose(out["kl"], token_kl(dense, cand), atol=1e-12)
    assert torch.equal(out["top1"], M.top1_agreement(dense, cand))
    assert torch.allclose(out["p_top_delta"], M.top_token_prob_delta(dense, cand), atol=1e-12)
    assert torch.allclose(out["nll"], M.next_token_nll(cand, ids), atol=1e-12)
    with pytest.raises(ValueError):
        M.compare_logits(dense, cand, ids[:-1])
