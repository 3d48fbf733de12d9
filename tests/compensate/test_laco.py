"""LaCo on tiny models: the mask survives bit-exactly, errors and KL go down, resume == uninterrupted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from laco_deploy.compensate import laco, run
from laco_deploy.config import CompensateConfig, DataConfig, ModelConfig
from laco_deploy.data import evaluation_windows
from laco_deploy.models import load_model

DATA = DataConfig(calib="builtin", samples=16, seqlen=32, seed=0)  # the text these margins were set on


def _cfg(**kw) -> CompensateConfig:
    # the walk alone: these tests measure layers; test_final_kl.py turns the final KL pass on
    base = {"samples": 16, "epochs": 3, "batch_size": 4, "lr": 1e-3, "final_kl_epochs": 0}
    base.update(kw)
    return CompensateConfig(**base)


def _weights(d: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _assert_same_pattern(pruned: Path, comp: Path, require_change: bool = True) -> None:
    a, b = _weights(pruned), _weights(comp)
    assert a.keys() == b.keys()
    changed = 0
    for k in a:
        assert a[k].shape == b[k].shape, k
        if k.endswith("proj.weight"):
            za, zb = a[k] == 0, b[k] == 0
            assert torch.equal(za, zb), f"{k}: zero pattern changed"
            assert not torch.signbit(b[k][zb]).any(), f"{k}: -0.0 written"
            changed += int(not torch.equal(a[k], b[k]))
    assert changed > 0 or not require_change, "no weight was trained"


@pytest.mark.parametrize("fixture", ["sparse_unstructured_dir", "sparse_24_dir", "sparse_structured_dir"])
def test_mask_preserved_exactly(request, tiny_llama_dir, tmp_path, fixture):
    sparse = request.getfixturevalue(fixture)
    res = run(ModelConfig(model=str(tiny_llama_dir)), DATA, _cfg(epochs=2), sparse, tmp_path / "out")
    _assert_same_pattern(sparse, tmp_path / "out")
    assert res.sparsity == res.settings["sparsity_before"] > 0
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["laco_deploy"]["stage"] == "compensate" and cfg["laco_deploy"]["method"] == "laco"
    assert cfg["laco_deploy"]["prune_method"] == "magnitude"
    doc = json.loads((tmp_path / "out" / "sparsity.json").read_text())
    assert doc["stage"] == "prune" and doc["compensate"]["matrices_with_changed_zero_count"] == []
    if fixture == "sparse_24_dir":
        w = _weights(tmp_path / "out")["model.layers.0.mlp.up_proj.weight"]
        assert ((w != 0).view(w.shape[0], -1, 4).sum(-1) <= 2).all()
    if fixture == "sparse_structured_dir":
        assert cfg["intermediate_size"] == 96 and "laco_layer_widths" not in cfg  # uniform: transformers' own key
    assert not (tmp_path / "out.ckpt").exists()


def _mean_kl(dense_dir: Path, cand_dir: Path) -> float:
    dense, cand = load_model(str(dense_dir)), load_model(str(cand_dir))
    ids = evaluation_windows(dense.tokenizer, "builtin", 4, 32)
    with torch.no_grad():
        lp = torch.log_softmax(dense.model(ids).logits, -1)
        lq = torch.log_softmax(cand.model(ids).logits, -1)
    return float((lp.exp() * (lp - lq)).sum(-1).mean())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])  # both, whichever one auto picks on this CPU
def test_lowers_layer_error_and_final_kl(tiny_llama_dir, sparse_unstructured_dir, tmp_path, precision):
    res = run(ModelConfig(model=str(tiny_llama_dir)), DATA, _cfg(epochs=4, precision=precision), sparse_unstructured_dir,
              tmp_path / "out")
    assert res.settings["compensate"]["precision"] == precision
    assert len(res.per_layer) == 2
    for rec in res.per_layer:
        assert rec["nmse_after"] < rec["nmse_before"]
        assert rec["measured_on"] == "validation"
        assert rec["device_working_set"]["total"] > 0 and rec["time_s"] > 0
    kl_pruned = _mean_kl(tiny_llama_dir, sparse_unstructured_dir)
    kl_comp = _mean_kl(tiny_llama_dir, tmp_path / "out")
    assert kl_comp < kl_pruned
    assert res.settings["memory"]["device_working_set_mib"]["total"] > 0
    _assert_same_pattern(sparse_unstructured_dir, tmp_path / "out")


@pytest.mark.parametrize("loss", ["mse", "cos_mse", "subblock"])
def test_other_losses_train(tiny_llama_dir, sparse_unstructured_dir, tmp_path, loss):
    res = run(ModelConfig(model=str(tiny_llama_dir)), DATA, _cfg(loss=loss, epochs=2, train_norms=loss == "subblock"),
              sparse_unstructured_dir, tmp_path / "out")
    assert all(r["loss_after"] < r["loss_before"] for r in res.per_layer)
    _assert_same_pattern(sparse_unstructured_dir, tmp_path / "out")


class _Killed(RuntimeError):
    pass


def killed_then_resumed(mcfg, ccfg, sparse: Path, tmp_path: Path, monkeypatch, after_kill=None) -> tuple[dict, dict, Any]:
    """Weights of an uninterrupted run and of one killed in layer 1 (`after_kill()` then runs), then
    resumed. -> (full weights, resumed weights, the resumed run's result)"""
    run(mcfg, DATA, ccfg, sparse, tmp_path / "full")
    real_fit = laco.LayerTrainer.fit

    def fit_then_die(self, *a, **kw):
        if self.seed == DATA.seed + 1:  # layer 1: layer 0 is already checkpointed
            raise _Killed("simulated kill")
        return real_fit(self, *a, **kw)

    monkeypatch.setattr(laco.LayerTrainer, "fit", fit_then_die)
    with pytest.raises(_Killed):
        run(mcfg, DATA, ccfg, sparse, tmp_path / "resumed")
    if after_kill is not None:
        after_kill()
    monkeypatch.setattr(laco.LayerTrainer, "fit", real_fit)
    res = run(mcfg, DATA, ccfg, sparse, tmp_path / "resumed", resume=True)
    return _weights(tmp_path / "full"), _weights(tmp_path / "resumed"), res


def test_resume_equals_uninterrupted(tiny_llama_dir, sparse_unstructured_dir, tmp_path, monkeypatch):
    def killed():
        assert (tmp_path / "resumed.ckpt" / "layer_000.safetensors").is_file()
        assert not (tmp_path / "resumed").exists()

    mcfg, ccfg = ModelConfig(model=str(tiny_llama_dir)), _cfg(epochs=2)
    full, resumed, res = killed_then_resumed(mcfg, ccfg, sparse_unstructured_dir, tmp_path, monkeypatch, killed)
    assert full.keys() == resumed.keys()
    for k in full:
        assert torch.equal(full[k], resumed[k]), k
    assert len(res.per_layer) == 2


def test_resume_with_other_settings_is_refused(tiny_llama_dir, sparse_unstructured_dir, tmp_path, monkeypatch):
    from laco_deploy.errors import ConfigError

    monkeypatch.setattr(laco.LayerTrainer, "fit", lambda self, *a, **k: (_ for _ in ()).throw(_Killed("x")))
    with pytest.raises(_Killed):
        run(ModelConfig(model=str(tiny_llama_dir)), DATA, _cfg(), sparse_unstructured_dir, tmp_path / "o")
    with pytest.raises(ConfigError, match="other settings"):
        run(ModelConfig(model=str(tiny_llama_dir)), DATA, _cfg(lr=5e-4), sparse_unstructured_dir, tmp_path / "o", resume=True)


def test_qwen2_biases_with_disk_offload(tiny_qwen2_dir, tmp_path):
    from compensate_sparse import make_unstructured

    sparse = make_unstructured(tiny_qwen2_dir, tmp_path / "qwen_sparse")
    res = run(ModelConfig(model=str(tiny_qwen2_dir)), DATA, _cfg(epochs=2, offload="disk"), sparse, tmp_path / "out")
    _assert_same_pattern(sparse, tmp_path / "out")
    a, b = _weights(sparse), _weights(tmp_path / "out")
    assert not torch.equal(a["model.layers.0.self_attn.q_proj.bias"], b["model.layers.0.self_attn.q_proj.bias"])
    assert all(r["nmse_after"] <= r["nmse_before"] for r in res.per_layer)


def test_after_real_wanda_prune(tiny_llama_dir, tmp_path):
    """The contract with the prune stage: its directory, config summary and sparsity.json."""
    from laco_deploy.config import PruneConfig
    from laco_deploy.prune import run as prune

    pruned = tmp_path / "wanda24"
    prune(ModelConfig(model=str(tiny_llama_dir)), DataConfig(samples=8, seqlen=32), PruneConfig(method="wanda", pattern="2:4"),
          pruned, device=torch.device("cpu"))
    res = run(ModelConfig(model=str(tiny_llama_dir)), DATA, _cfg(epochs=2), pruned, tmp_path / "out")
    _assert_same_pattern(pruned, tmp_path / "out")
    before = json.loads((pruned / "sparsity.json").read_text())
    after = json.loads((tmp_path / "out" / "sparsity.json").read_text())
    assert after["overall"] == before["overall"] and after["compensate"]["sparsity_after"] == before["overall"]["sparsity"]
    assert res.sparsity == before["overall"]["sparsity"] and res.pattern == "2:4"
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())["laco_deploy"]
    assert cfg["prune_method"] == "wanda" and cfg["stage"] == "compensate" and cfg["pattern"] == "2:4"


def test_model_guard_compares_with_the_pruned_model(tiny_llama_dir, sparse_unstructured_dir, tmp_path):
    """The recovered model is scored against the pruned one on held-out samples at the model level."""
    res = run(ModelConfig(model=str(tiny_llama_dir)), DATA, _cfg(epochs=3), sparse_unstructured_dir, tmp_path / "out")
    guard = res.settings["model_guard"]
    assert guard["kept"] and guard["kl_recovered"] < guard["kl_pruned"] and guard["samples"] == 2  # 1/8 of 16
    assert any("held-out KL to the dense logits: pruned" in n for n in res.notes)


def test_model_guard_puts_the_pruned_weights_back_when_recovery_hurts(tiny_llama_dir, sparse_unstructured_dir,
                                                                     tmp_path, monkeypatch):
    """Every layer's fit is wrecked after its own check (noise under the mask): the model-level guard
    sees the recovered model worse than the pruned one and writes the pruned weights."""
    real = laco.make_step

    def wrecking(*args, **kw):
        step = real(*args, **kw)

        def wreck(ctx):
            record = step(ctx)
            with torch.no_grad():
                for p in ctx.layer.parameters():
                    if p.dim() == 2:
                        p.mul_(1 + 3 * torch.randn_like(p))  # zeros stay zero
            return record

        return wreck

    monkeypatch.setattr(laco, "make_step", wrecking)
    res = run(ModelConfig(model=str(tiny_llama_dir)), DATA, _cfg(epochs=1), sparse_unstructured_dir, tmp_path / "out")
    guard = res.settings["model_guard"]
    assert not guard["kept"] and guard["kl_recovered"] > guard["kl_pruned"]
    assert any("WORSE" in n for n in res.notes)
    pruned, out = _weights(sparse_unstructured_dir), _weights(tmp_path / "out")
    assert all(torch.equal(pruned[k], out[k]) for k in pruned if ".layers." in k)


def test_model_guard_kl_in_token_chunks_equals_the_full_logits(tiny_llama_dir):
    """The guard makes the [seq, vocab] logits KL_CHUNK_TOKENS tokens at a time (a 262k vocabulary would
    hold ~7 copies of 134 MB per sample otherwise); its KL equals the one over whole samples."""
    from laco_deploy.compensate.guard import ModelGuard
    from laco_deploy.compensate.klpass import head_logits, kl_to_teacher
    from laco_deploy.engine.cache import ActivationCache
    from laco_deploy.models import load_model
    from laco_deploy.sizing import KL_CHUNK_TOKENS

    model = load_model(str(tiny_llama_dir)).model.eval()
    seq = 2 * KL_CHUNK_TOKENS + 7  # a ragged last chunk
    ids = torch.randint(0, model.config.vocab_size, (3, seq), generator=torch.Generator().manual_seed(0))
    rows = torch.tensor([0, 2])
    teacher = ActivationCache((3, seq, model.config.hidden_size))
    teacher.data.copy_(torch.randn(teacher.shape, generator=torch.Generator().manual_seed(1)))
    guard = ModelGuard(lambda m: None)
    guard.capture(model, ids, rows, torch.device("cpu"), 2)
    pruned = guard.pruned.clone()
    with torch.no_grad():
        whole = sum(float(kl_to_teacher(head_logits(model, pruned[j:j + 1], None, norm=False),
                                        head_logits(model, teacher.data[rows[j]][None], None, norm=True)))
                    for j in range(len(rows))) / len(rows)
    record = guard.check(model, ids, rows, len(rows), teacher, torch.device("cpu"), 2)
    assert record["kl_pruned"] == pytest.approx(whole, rel=1e-5)
    assert record["kl_recovered"] == pytest.approx(whole, rel=1e-5)  # the same weights
