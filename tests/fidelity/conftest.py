"""Fixtures for the fidelity tests: a tiny Llama trained briefly on the builtin calibration text
(so it predicts better than chance and a damaged copy has a measurably worse perplexity), and
copies of it with noise of known size added to the decoder layers' weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import tiny
import torch

NOISE = (0.2, 1.0)  # relative weight noise of the mildly and the strongly damaged copy


def _train(model, tokenizer, steps: int = 150, seqlen: int = 48, batch: int = 8):
    from laco_deploy.data import calibration_samples

    ids = calibration_samples(tokenizer, "builtin", steps * batch, seqlen, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
    model.train()
    for s in range(steps):
        x = ids[s * batch : (s + 1) * batch]
        loss = model(x, labels=x, use_cache=False).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def perturb(model, scale: float, seed: int = 0):
    """Add N(0, (scale * std(W))^2) noise to every 2-D weight inside the decoder layers."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.model.layers.named_parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=gen) * p.std() * scale)
    return model


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """Tiny models run fastest on one thread; two threads on a shared 2-core machine thrash."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def trained_dir(tmp_path_factory, bpe_tokenizer) -> Path:
    """3-layer Llama (hidden 64, vocab 512) after 150 AdamW steps on calibration text (~2 s)."""
    torch.manual_seed(0)
    model = _train(tiny.build_model(tiny.llama_config(layers=3)), bpe_tokenizer)
    return tiny.save_tiny(model, bpe_tokenizer, tmp_path_factory.mktemp("fid_dense"))


@pytest.fixture(scope="session")
def perturbed_dirs(tmp_path_factory, trained_dir, bpe_tokenizer) -> dict[float, Path]:
    """Noise scale -> directory of the trained model with that much relative weight noise."""
    from transformers import AutoModelForCausalLM

    out = {}
    for scale in NOISE:
        model = perturb(AutoModelForCausalLM.from_pretrained(trained_dir, dtype=torch.float32), scale)
        out[scale] = tiny.save_tiny(model, bpe_tokenizer, tmp_path_factory.mktemp(f"fid_noise_{scale}"))
    return out
