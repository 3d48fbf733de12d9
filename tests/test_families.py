"""Every supported model family through every stage, on tiny random-init models.

Each new family runs the whole `build` for both targets (prune, LaCo, export with its parity
check, fidelity, bench), every pruning method and pattern, and loads back from our own GGUF.
GGUF layouts are pinned in tests/exporters/test_gguf_families.py.
"""

from __future__ import annotations

import json

import pytest
import torch

import tiny

# fixture name -> (family, GGUF architecture)
NEW_FAMILIES = {
    "tiny_qwen3_dir": ("qwen3", "qwen3"),
}
SMALL_YAML = """
data: {samples: 4, seqlen: 32, eval_samples: 1, eval: builtin}
compensate: {epochs: 1}
bench: {repetitions: 1, n_prompt: 8, n_gen: 2, ppl_ctx: 16, ppl_windows: 1}
"""


@pytest.fixture(params=list(NEW_FAMILIES))
def family_dir(request):
    return request.getfixturevalue(request.param), NEW_FAMILIES[request.param]


@pytest.mark.parametrize("target", ["gguf", "onnx"])
def test_build_runs_every_stage(family_dir, target, tmp_path, cli):
    src, (_, arch) = family_dir
    (tmp_path / "small.yaml").write_text(SMALL_YAML)
    out = tmp_path / "build"
    code, stdout, stderr = cli("build", "--model", src, "--target", target, "--out", out, "--device", "cpu",
                               "--config", tmp_path / "small.yaml", "--json")
    assert code == 0, stderr[-2000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert set(manifest["stages"]) == {"prune", "compensate", "export", "fidelity", "bench"}
    export = manifest["stages"]["export"]["result"]["model"]  # the recovered model's export and its parity check
    fidelity = json.loads((out / "fidelity.json").read_text())
    assert fidelity and manifest["summary"]["sparsity"] == pytest.approx(0.5, abs=0.02)
    if target == "gguf":
        import gguf

        path = next(out.glob("model.*.gguf"))
        assert gguf.GGUFReader(str(path)).get_field("general.architecture").contents() == arch
        assert export["checks"]["parity_top1"] >= 0.9
    else:
        parity = export["checks"]["parity"]
        assert parity["top1_agreement"] >= 0.99 and parity["max_abs_logit_diff"] <= 1e-3


@pytest.mark.parametrize("method,pattern", [("magnitude", None), ("wanda", "2:4"), ("sparsegpt", None),
                                            ("sparsegpt", "4:8"), ("wanda", "structured")])
def test_prune_every_method_and_pattern(family_dir, method, pattern, tmp_path):
    from laco_deploy.config import DataConfig, ModelConfig, PruneConfig
    from laco_deploy.models import linear_modules, load_model
    from laco_deploy.prune import run

    src, _ = family_dir
    settings = {"structured": 0.5} if pattern == "structured" else {"pattern": pattern} if pattern else {"sparsity": 0.5}
    cfg = PruneConfig(method=method, **settings)
    res = run(ModelConfig(model=str(src), device="cpu"), DataConfig(samples=4, seqlen=32), cfg, tmp_path / "p")
    pruned, dense = load_model(str(tmp_path / "p")).model, load_model(str(src)).model
    layers = zip(pruned.model.layers, dense.model.layers)
    for p_layer, d_layer in layers:
        p_lin, d_lin = linear_modules(p_layer, cfg.targets), linear_modules(d_layer, cfg.targets)
        assert p_lin.keys() == d_lin.keys() and p_lin  # every prunable linear of the family was a target
        for name, lin in p_lin.items():
            if pattern == "structured":
                assert lin.weight.numel() < d_lin[name].weight.numel(), name  # physically smaller
            else:
                zeros = (lin.weight == 0).float().mean().item()
                assert zeros == pytest.approx(0.5, abs=0.01), name
    assert 0.4 <= res.sparsity <= 0.6
    ids = torch.randint(0, tiny.VOCAB, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.isfinite(pruned(ids).logits).all()


def test_loads_back_from_our_gguf(family_dir, tmp_path, cache_dir):
    """HF dir -> our GGUF (f32) -> laco-deploy's GGUF loader: the same logits."""
    from exporters.gguf import export
    from laco_deploy.models import load_model

    src, _ = family_dir
    res = export(src, tmp_path / "m.f32.gguf", "f32")
    again = load_model(str(res.path))
    assert again.kind == "gguf"
    ids = torch.randint(0, tiny.VOCAB, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = load_model(str(src)).model(ids).logits
        got = again.model(ids).logits
    assert (got - ref).abs().max().item() <= 1e-4
