"""Fidelity on the layer engine equals whole-model fidelity, and holds one decoder layer at a time.

The reference runs each model's own full forward pass per window (transformers, hooks on the decoder
layers for the per-layer outputs) and computes every metric from those logits; `fidelity.run` walks
the models side by side layer by layer with weights streamed from safetensors.
"""

from __future__ import annotations

import math

import pytest
import tiny
import torch

from laco_deploy.config import DataConfig, FidelityConfig, ModelConfig
from laco_deploy.data import eval_domains, evaluation_windows
from laco_deploy.fidelity import metrics as M
from laco_deploy.fidelity import run
from laco_deploy.fidelity.layerwise import LayerCurves, forward_with_layers

DATA = DataConfig(eval="domains", eval_samples=2, seqlen=40)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def other_head_dir(trained_dir, bpe_tokenizer, tmp_path_factory):
    """The trained model with noise in its (tied) embedding matrix too: a head no other model shares."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(trained_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in (model.model.embed_tokens.weight, model.model.layers[1].mlp.down_proj.weight):
            p.add_(torch.randn(p.shape, generator=gen) * p.std() * 0.3)
    return tiny.save_tiny(model, bpe_tokenizer, tmp_path_factory.mktemp("fid_other_head"))


def _reference(dense_dir, cands: dict, tokenizer) -> dict:
    """Every number fidelity reports, from whole-model forward passes, window by window."""
    from transformers import AutoModelForCausalLM

    load = lambda p: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()  # noqa: E731
    dense, models = load(dense_dir), {label: load(p) for label, p in cands.items()}
    sums = {label: {"kl": [], "top1": 0, "delta": 0.0, "nll": [], "dom": {}} for label in cands}
    curves = {label: LayerCurves(len(dense.model.layers)) for label in cands}
    dense_nll, dense_dom = [], {}
    for domain, spec in eval_domains(DATA.eval):
        for ids in evaluation_windows(tokenizer, spec, DATA.eval_samples, DATA.seqlen):
            d_logits, d_hidden = forward_with_layers(dense, ids, CPU)
            nll = M.next_token_nll(d_logits, ids)
            dense_nll.append(nll)
            dense_dom.setdefault(domain, []).append(nll)
            for label, model in models.items():
                c_logits, c_hidden = forward_with_layers(model, ids, CPU)
                curves[label].add(c_hidden, d_hidden)
                cmp = M.compare_logits(d_logits, c_logits, ids)
                s = sums[label]
                s["kl"].append(cmp["kl"])
                s["top1"] += int(cmp["top1"].sum())
                s["delta"] += cmp["p_top_delta"].sum().item()
                s["nll"].append(cmp["nll"])
                s["dom"].setdefault(domain, {"kl": [], "top1": 0, "nll": []})
                s["dom"][domain]["kl"].append(cmp["kl"])
                s["dom"][domain]["top1"] += int(cmp["top1"].sum())
                s["dom"][domain]["nll"].append(cmp["nll"])
    ppl = lambda parts: math.exp(torch.cat(parts).mean().item())  # noqa: E731
    out = {"dense_ppl": ppl(dense_nll), "dense_domains": {d: ppl(v) for d, v in dense_dom.items()}}
    for label, s in sums.items():
        kl = torch.cat(s["kl"])
        out[label] = {
            "kl_mean": kl.mean().item(), "kl_max": kl.max().item(), "top1": s["top1"] / kl.numel(),
            "p_top_delta": s["delta"] / kl.numel(), "ppl": ppl(s["nll"]), "per_layer": curves[label].to_list(),
            "domains": {d: {"ppl": ppl(v["nll"]), "kl_mean": torch.cat(v["kl"]).mean().item(),
                            "top1": v["top1"] / torch.cat(v["kl"]).numel()} for d, v in s["dom"].items()},
        }
    return out


def test_layer_engine_equals_whole_model_fidelity(trained_dir, perturbed_dirs, other_head_dir, bpe_tokenizer, tmp_path):
    cands = {"mild": perturbed_dirs[min(perturbed_dirs)], "strong": perturbed_dirs[max(perturbed_dirs)],
             "other_head": other_head_dir}
    result = run(ModelConfig(model=str(trained_dir), device="cpu"), DATA, FidelityConfig(), cands, tmp_path)
    ref = _reference(trained_dir, cands, bpe_tokenizer)
    close = lambda a, b: a == pytest.approx(b, rel=1e-5, abs=1e-8)  # noqa: E731
    assert close(result.dense["ppl"], ref["dense_ppl"])
    assert all(close(result.dense["domains"][d]["ppl"], p) for d, p in ref["dense_domains"].items())
    for label in cands:
        got, want = result.candidates[label], ref[label]
        m = got["metrics"]
        assert close(m["kl"]["mean"], want["kl_mean"]) and close(m["kl"]["max"], want["kl_max"]), label
        assert m["top1"] == want["top1"] and close(m["p_top_delta"], want["p_top_delta"]) and close(m["ppl"], want["ppl"])
        assert set(got["domains"]) == set(want["domains"])
        for d, wd in want["domains"].items():
            gd = got["domains"][d]
            assert close(gd["ppl"], wd["ppl"]) and close(gd["kl_mean"], wd["kl_mean"]) and gd["top1"] == wd["top1"], (label, d)
        assert len(got["per_layer"]) == len(want["per_layer"]) == 3
        for g, w in zip(got["per_layer"], want["per_layer"]):
            assert close(g["rel_error"], w["rel_error"]) and close(g["cosine"], w["cosine"]), (label, g, w)
    assert result.candidates["other_head"]["metrics"]["kl"]["mean"] > result.candidates["mild"]["metrics"]["kl"]["mean"]


def test_one_decoder_layer_in_memory_at_a_time(trained_dir, perturbed_dirs, monkeypatch, tmp_path):
    """While the models are walked, every decoder layer but the one running stays on `meta`."""
    from laco_deploy.engine import walk as W

    seen: list[int] = []
    models_seen: list = []
    real_load = W._load

    def spy(i, lane):  # the walk brings layer i of one model in: count what is not on `meta` then
        layer = real_load(i, lane)
        models_seen.append(lane.model)
        live = {id(m): m for m in models_seen}.values()
        seen.append(sum(not p.is_meta for m in live for layer_ in m.model.layers for p in layer_.parameters()))
        return layer

    monkeypatch.setattr(W, "_load", spy)
    cands = {"mild": perturbed_dirs[min(perturbed_dirs)], "strong": perturbed_dirs[max(perturbed_dirs)]}
    run(ModelConfig(model=str(trained_dir), device="cpu"), DataConfig(eval="builtin", eval_samples=2, seqlen=32),
        FidelityConfig(), cands, tmp_path)
    one_layer = sum(1 for _ in tiny.build_model(tiny.llama_config(layers=3)).model.layers[0].parameters())
    assert len(seen) == 3 * 3 and set(seen) == {one_layer}
