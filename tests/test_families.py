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
    "tiny_gemma2_dir": ("gemma2", "gemma2"),
    "tiny_gemma3_dir": ("gemma3_text", "gemma3"),
    "tiny_phi3_dir": ("phi3", "phi3"),
    "tiny_smollm3_dir": ("smollm3", "smollm3"),
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
    # no loss configured: the family's (Gemma's residual stream needs the per-channel one)
    recorded = json.loads((out / "recovered" / "config.json").read_text())["laco_deploy"]
    assert recorded["loss"] == ("channel_nmse" if arch.startswith("gemma") else "nmse")
    assert recorded["lr"] == (3e-4 if arch.startswith("gemma") else 3e-3)  # and the family's rate (CPU: unscaled)
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
    from laco_deploy import families
    from laco_deploy.config import DataConfig, ModelConfig, PruneConfig
    from laco_deploy.models import linear_modules, load_model
    from laco_deploy.prune import run

    src, (model_type, _) = family_dir
    settings = {"structured": 0.5} if pattern == "structured" else {"pattern": pattern} if pattern else {"sparsity": 0.5}
    cfg = PruneConfig(method=method, **settings)
    res = run(ModelConfig(model=str(src), device="cpu"), DataConfig(samples=4, seqlen=32), cfg, tmp_path / "p")
    pruned, dense = load_model(str(tmp_path / "p")).model, load_model(str(src)).model
    family = families.of_config(dense.config)
    assert family is not None and family.model_type == model_type
    layers = zip(pruned.model.layers, dense.model.layers)
    for p_layer, d_layer in layers:
        p_lin, d_lin = linear_modules(p_layer, cfg.targets), linear_modules(d_layer, cfg.targets)
        assert {n.rsplit(".", 1)[-1] for n in p_lin} == set(family.attention + family.ffn)  # all were targets
        for name, lin in p_lin.items():
            if pattern == "structured":  # physically smaller; heads stay where the family cannot lose them per layer
                shrinks = name.startswith("mlp.") or family.structured_heads
                assert (lin.weight.numel() < d_lin[name].weight.numel()) == shrinks, name
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


def test_fused_matrices_are_cut_consistently(tiny_phi3_dir, tmp_path):
    """Phi-3's fused gate_up_proj loses the same FFN channels in its gate and up halves; its fused
    qkv_proj keeps every head (refused per layer, with FFN channels still removed)."""
    from laco_deploy.config import DataConfig, ModelConfig, PruneConfig
    from laco_deploy.models import load_model
    from laco_deploy.prune import run

    res = run(ModelConfig(model=str(tiny_phi3_dir), device="cpu"), DataConfig(samples=4, seqlen=32),
              PruneConfig(structured=0.25), tmp_path / "p")
    dense = load_model(str(tiny_phi3_dir)).model
    pruned = load_model(str(tmp_path / "p")).model
    for i, rec in enumerate(res.per_layer):
        keep = torch.tensor(rec["kept_ffn_channels"])
        assert len(keep) == 96 and "kept_head_groups" not in rec
        d_mlp, p_mlp = dense.model.layers[i].mlp, pruned.model.layers[i].mlp
        gate, up = d_mlp.gate_up_proj.weight[:128], d_mlp.gate_up_proj.weight[128:]
        assert torch.equal(p_mlp.gate_up_proj.weight, torch.cat([gate[keep], up[keep]]))
        assert torch.equal(p_mlp.down_proj.weight, d_mlp.down_proj.weight[:, keep])
        assert torch.equal(pruned.model.layers[i].self_attn.qkv_proj.weight, dense.model.layers[i].self_attn.qkv_proj.weight)


@pytest.mark.parametrize("settings,message", [
    ({"targets": ("q_proj", "down_proj")}, "Phi-3 fuses q_proj, k_proj, v_proj into one qkv_proj"),
    ({"structured": 0.5, "targets": ("q_proj", "k_proj", "v_proj", "o_proj")}, "head groups cannot be removed per layer"),
])
def test_phi3_refuses_what_fused_matrices_cannot_do(tiny_phi3_dir, tmp_path, settings, message):
    from laco_deploy.config import DataConfig, ModelConfig, PruneConfig
    from laco_deploy.errors import ConfigError
    from laco_deploy.prune import run

    with pytest.raises(ConfigError, match=message):
        run(ModelConfig(model=str(tiny_phi3_dir), device="cpu"), DataConfig(samples=2, seqlen=16),
            PruneConfig(**settings), tmp_path / "p")
    assert not (tmp_path / "p").exists()
