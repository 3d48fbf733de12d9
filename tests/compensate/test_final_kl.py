"""The final KL pass after the LaCo walk (compensate/distill.py, klpass.py): its teacher equals the
dense model's logits, it lowers the KL to the dense model, keeps the mask, resumes exactly, equals a
plain whole-model pass, runs streamed from disk like in RAM, and is skipped with a reason where its
memory is short."""

from __future__ import annotations

import pytest
import torch
from test_laco import DATA, _assert_same_pattern, _cfg, _Killed, _mean_kl, _weights

from laco_deploy.compensate import distill, klpass, run
from laco_deploy.config import ModelConfig
from laco_deploy.data import calibration_samples
from laco_deploy.models import load_model


def test_teacher_is_the_dense_models_logits(tiny_llama_dir, sparse_unstructured_dir, tmp_path, monkeypatch):
    """The dense twin's last hidden states of the pass's samples, through the pruned model's head,
    give the dense logits; the pass's embeddings are those samples'."""
    seen = {}

    def capture(model, inputs, teacher, *a, **kw):
        seen["logits"] = klpass.head_logits(model, teacher.data.clone(), None)
        seen["embeddings"] = inputs.rows(torch.arange(len(inputs)), torch.device("cpu"))  # embedded on demand
        return {"kl_before": 0.0, "kl_after": 0.0, "steps": 0, "train_s": 0.0, "kept": True}

    monkeypatch.setattr(distill, "final_kl", capture)
    run(ModelConfig(model=str(tiny_llama_dir)), DATA, _cfg(epochs=1, precision="fp32", final_kl_epochs=1),
        sparse_unstructured_dir, tmp_path / "out")
    dense = load_model(str(tiny_llama_dir))
    # the walk's 16 samples, then 16 fresh ones for the pass, one draw of the same seed
    ids = calibration_samples(dense.tokenizer, DATA.calib, 32, DATA.seqlen, DATA.seed)
    assert torch.equal(ids[:16], calibration_samples(dense.tokenizer, DATA.calib, 16, DATA.seqlen, DATA.seed))
    with torch.no_grad():
        ref = dense.model(ids[16:], use_cache=False).logits
        embedded = dense.model.model.embed_tokens(ids[16:])
    assert torch.allclose(seen["logits"], ref, atol=1e-4, rtol=1e-4)
    assert torch.equal(seen["embeddings"], embedded)


def test_pass_lowers_kl_and_keeps_mask(tiny_llama_dir, sparse_unstructured_dir, tmp_path):
    mcfg = ModelConfig(model=str(tiny_llama_dir))
    run(mcfg, DATA, _cfg(epochs=2, final_kl_epochs=0), sparse_unstructured_dir, tmp_path / "walk")
    res = run(mcfg, DATA, _cfg(epochs=2, final_kl_epochs=3, final_kl_lr=1e-3), sparse_unstructured_dir,
              tmp_path / "walk_kl")
    final = res.settings["final_kl"]
    assert final["kl_after"] < final["kl_before"] and final["steps"] == 3 * 4  # 14 of 16 fresh samples, batch 4
    assert any("final KL pass" in n for n in res.notes)
    assert final["peak_mib"] > 0 and final["memory_kind"] in ("rss", "cuda_max_allocated")
    _assert_same_pattern(sparse_unstructured_dir, tmp_path / "walk_kl")
    assert _mean_kl(tiny_llama_dir, tmp_path / "walk_kl") < _mean_kl(tiny_llama_dir, tmp_path / "walk")


def test_structured_model_keeps_its_shapes_and_never_leaves_worse(tiny_llama_dir, sparse_structured_dir, tmp_path):
    """On this tiny model 14 samples at lr 1e-3 overfit (held-out KL up): the walk's weights come back."""
    mcfg = ModelConfig(model=str(tiny_llama_dir))
    run(mcfg, DATA, _cfg(epochs=1, final_kl_epochs=0), sparse_structured_dir, tmp_path / "walk")
    res = run(mcfg, DATA, _cfg(epochs=1, final_kl_epochs=2, final_kl_lr=1e-3), sparse_structured_dir, tmp_path / "out")
    final = res.settings["final_kl"]
    assert final["kl_after"] <= final["kl_before"]
    _assert_same_pattern(sparse_structured_dir, tmp_path / "walk", require_change=True)
    walk, out = _weights(tmp_path / "walk"), _weights(tmp_path / "out")
    assert walk.keys() == out.keys() and all(walk[k].shape == out[k].shape for k in walk)
    if not final["kept"]:
        assert final["kl_trained"] >= final["kl_before"]
        assert all(torch.equal(walk[k], out[k]) for k in walk)


def test_resume_in_the_pass_equals_uninterrupted(tiny_llama_dir, sparse_unstructured_dir, tmp_path, monkeypatch):
    """Killed in the middle of the pass (after some updates), the resumed run ends on the same weights."""
    mcfg = ModelConfig(model=str(tiny_llama_dir))
    ccfg = _cfg(epochs=1, final_kl_epochs=2, final_kl_lr=1e-2, final_kl_optimizer="adafactor")
    run(mcfg, DATA, ccfg, sparse_unstructured_dir, tmp_path / "full")
    real, calls = klpass.LayerStack.backward, []

    def die_at_third(self, *a, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise _Killed("simulated kill during the final pass")
        return real(self, *a, **kw)

    monkeypatch.setattr(klpass.LayerStack, "backward", die_at_third)
    with pytest.raises(_Killed):
        run(mcfg, DATA, ccfg, sparse_unstructured_dir, tmp_path / "resumed")
    assert not (tmp_path / "resumed").exists()  # no output that looks complete
    monkeypatch.setattr(klpass.LayerStack, "backward", real)
    run(mcfg, DATA, ccfg, sparse_unstructured_dir, tmp_path / "resumed", resume=True)
    full, resumed = _weights(tmp_path / "full"), _weights(tmp_path / "resumed")
    assert all(torch.equal(full[k], resumed[k]) for k in full)


@pytest.mark.parametrize("optimizer", ["adafactor", "adamw"])
def test_streamed_from_disk_equals_in_ram(tiny_llama_dir, sparse_unstructured_dir, tmp_path, optimizer):
    """--offload disk: the pass runs (no longer skipped), keeps its optimizer state on disk, and
    trains the same weights as in RAM."""
    mcfg = ModelConfig(model=str(tiny_llama_dir))
    kw = {"epochs": 1, "final_kl_epochs": 2, "final_kl_lr": 1e-2 if optimizer == "adafactor" else 1e-3,
          "final_kl_optimizer": optimizer}
    ram = run(mcfg, DATA, _cfg(**kw), sparse_unstructured_dir, tmp_path / "ram")
    disk = run(mcfg, DATA, _cfg(offload="disk", **kw), sparse_unstructured_dir, tmp_path / "disk")
    assert disk.settings["final_kl"]["steps"] == ram.settings["final_kl"]["steps"] == 8
    assert (ram.settings["final_kl"]["optimizer_state_on"], disk.settings["final_kl"]["optimizer_state_on"]) == ("memory", "disk")
    assert disk.settings["final_kl"]["kl_after"] < disk.settings["final_kl"]["kl_before"]
    a, b = _weights(tmp_path / "ram"), _weights(tmp_path / "disk")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    _assert_same_pattern(sparse_unstructured_dir, tmp_path / "disk")


def test_skipped_with_a_reason(tiny_llama_dir, sparse_unstructured_dir, tmp_path, monkeypatch, caplog):
    sparse = load_model(str(sparse_unstructured_dir)).model
    cfg, cpu = _cfg(final_kl_epochs=1), torch.device("cpu")
    assert distill.skip_reason(sparse, cfg, 32, cpu, streamed=True) is None
    monkeypatch.setattr(distill.sizing, "available_bytes", lambda: 2**10)
    reason = distill.skip_reason(sparse, cfg, 32, cpu, streamed=False)
    assert reason is not None and "GiB" in reason and cfg.final_kl_optimizer in reason
    res = run(ModelConfig(model=str(tiny_llama_dir)), DATA, _cfg(epochs=1, final_kl_epochs=1), sparse_unstructured_dir,
              tmp_path / "out")
    assert "final_kl" not in res.settings
    assert any("final KL pass on the dense logits is skipped" in r.getMessage() for r in caplog.records)


def test_invalid_values_are_reported():
    errs = (_cfg(final_kl_epochs=-1).validate() + _cfg(final_kl_lr=0.0).validate()
            + _cfg(final_kl_optimizer="sgd").validate())
    assert len(errs) == 3 and all("final_kl" in e for e in errs)


def test_quant_aware_pass_keeps_mask(tiny_llama_dir, sparse_unstructured_dir, tmp_path):
    """--quant-aware: the pass trains through the fake-quantized weights; the mask stays bit-exact."""
    res = run(ModelConfig(model=str(tiny_llama_dir)), DATA,
              _cfg(epochs=1, quant_aware="q8_0", final_kl_epochs=2, final_kl_lr=1e-3), sparse_unstructured_dir,
              tmp_path / "out")
    final = res.settings["final_kl"]
    assert final["steps"] == 8 and final["kl_after"] <= final["kl_before"]
    _assert_same_pattern(sparse_unstructured_dir, tmp_path / "out")
    assert not (tmp_path / "out.ckpt").exists()  # the starting weights' scratch file went with the checkpoints

