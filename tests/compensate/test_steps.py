"""The step policy (compensate/steps.py) for a given device memory and model size, on CPU: the
device's capacity is passed in (devices.Traits), so a GPU's choices are tested without one."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from laco_deploy import devices, memplan, sizing, structured
from laco_deploy.buildconfig import BuildConfig
from laco_deploy.compensate import steps
from laco_deploy.config import CompensateConfig

GIB = 2**30


def _weights(**shape) -> dict[str, int]:
    from transformers import LlamaConfig

    return sizing.weight_bytes(structured.skeleton(LlamaConfig(**shape)))


@pytest.fixture(scope="module")
def smollm2() -> dict[str, int]:
    """The default model's shape (SmolLM2-135M)."""
    return _weights(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def tinyllama() -> dict[str, int]:
    """TinyLlama-1.1B's shape."""
    return _weights(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                    num_attention_heads=32, num_key_value_heads=4, tie_word_embeddings=False)


def gpu(free_gib: float) -> devices.Traits:
    return devices.Traits(accelerator=True, bf16=True, free_bytes=int(free_gib * GIB))


CPU = devices.Traits(accelerator=False, bf16=False, free_bytes=None)
PAPER = {"seqlen": 256, "train_samples": 1792}  # 2,048 samples, 1/8 held out


def test_cpu_keeps_its_default_and_explicit_batches_win(smollm2):
    cfg = CompensateConfig(lr=3e-3)  # the family's, as the stage resolves it before sizing steps
    p = steps.plan(cfg, w=smollm2, traits=CPU, **PAPER)
    assert (p.batch_size, p.final_kl_batch_size, p.lr_scale) == (cfg.cpu_batch_size, cfg.cpu_batch_size, 1.0)
    applied = p.apply(cfg)
    assert (applied.lr, applied.final_kl_lr, applied.lora_lr) == (cfg.lr, cfg.kl_lr, cfg.lora_lr)
    explicit = steps.plan(CompensateConfig(batch_size=5), w=smollm2, traits=gpu(139), **PAPER)
    assert (explicit.batch_size, explicit.final_kl_batch_size, explicit.lr_scale) == (5, 5, 1.0)


def test_an_h200_takes_steps_of_the_target_tokens(smollm2):
    """139 GiB free: the default model's step grows to 16,384 tokens (64 x 256), its final pass too,
    and the learning rates by sqrt(64 / 2)."""
    cfg = CompensateConfig(lr=3e-3)
    p = steps.plan(cfg, w=smollm2, traits=gpu(139), **PAPER)
    assert p.batch_size * PAPER["seqlen"] == cfg.gpu_tokens_per_step
    assert p.final_kl_batch_size == p.batch_size
    assert p.lr_scale == pytest.approx(math.sqrt(64 / 2))
    applied = p.apply(cfg)
    assert applied.lr == pytest.approx(cfg.lr * math.sqrt(32)) and applied.final_kl_lr == pytest.approx(
        cfg.kl_lr * math.sqrt(32))
    with pytest.raises(ValueError, match="compensate.lr"):  # an unset rate would go unscaled
        p.apply(CompensateConfig())


@pytest.mark.parametrize("free_gib", [2, 8, 24, 139])
def test_batches_are_the_largest_that_fit(smollm2, tinyllama, free_gib):
    """Each batch fits its share of the free memory and twice it would not (unless capped at the
    target tokens); the final pass (one layer at a time, its optimizer state) never takes more than the walk."""
    cfg = CompensateConfig()
    room = cfg.memory_share * free_gib * GIB
    cap = cfg.gpu_tokens_per_step // PAPER["seqlen"]
    for w in (smollm2, tinyllama):
        p = steps.plan(cfg, w=w, traits=gpu(free_gib), **PAPER)
        for batch, need in ((p.batch_size, lambda t: steps.layer_step_bytes(w, t, False)),
                            (p.final_kl_batch_size, lambda t: sizing.final_kl_device_bytes(w, t, cfg.final_kl_optimizer))):
            tokens = batch * PAPER["seqlen"]
            assert batch == 1 or need(tokens) <= room
            assert batch == cap or need(2 * tokens) > room
        assert p.final_kl_batch_size <= p.batch_size


def test_memory_decides_on_a_small_gpu(smollm2, tinyllama):
    """On 8 GiB the default model's final pass takes the walk's 64 (it holds one layer at a time and
    makes its logits 32 tokens at a time); the 1.1B shape's walk drops to 32 and its pass to 1 with
    AdamW, whose moments (7.7 GiB) cannot fit (distill.skip_reason then skips it, saying why), or 16
    with Adafactor's factored state."""
    small = steps.plan(CompensateConfig(), w=smollm2, traits=gpu(8), **PAPER)
    assert (small.batch_size, small.final_kl_batch_size) == (64, 64)
    big = steps.plan(CompensateConfig(final_kl_optimizer="adamw"), w=tinyllama, traits=gpu(8), **PAPER)
    assert (big.batch_size, big.final_kl_batch_size) == (32, 1)
    factored = steps.plan(CompensateConfig(final_kl_optimizer="adafactor"), w=tinyllama, traits=gpu(8), **PAPER)
    assert (factored.batch_size, factored.final_kl_batch_size) == (32, 16)
    lora = steps.plan(CompensateConfig(method="lora"), w=smollm2, traits=gpu(8), **PAPER)
    assert lora.batch_size == 2  # LoRA's step is the whole model's


def test_few_samples_keep_enough_steps(smollm2):
    p = steps.plan(CompensateConfig(), seqlen=256, train_samples=28, w=smollm2, traits=gpu(139))
    assert p.batch_size == 2 and 28 // p.batch_size >= steps.MIN_STEPS_PER_EPOCH


def test_unknown_capacity_follows_the_target_tokens():
    p = steps.plan(CompensateConfig(), w=None, traits=devices.Traits(True, True, None), **PAPER)
    assert p.batch_size == p.final_kl_batch_size == 64


def test_activation_caches_stay_on_the_device_when_they_fit(smollm2, tinyllama):
    cfg = CompensateConfig(batch_size=64)
    assert steps.fits_on_device(smollm2, cfg, 4096, 256, gpu(139))  # 2 caches of 4,096 x 256 x 576 fp32: 2.3 GiB
    assert not steps.fits_on_device(smollm2, cfg, 4096, 256, gpu(8))
    assert not steps.fits_on_device(tinyllama, cfg, 4096, 256, gpu(24))  # 16 GiB of caches
    assert not steps.fits_on_device(smollm2, dataclasses.replace(cfg, offload="disk"), 4096, 256, gpu(139))
    assert not steps.fits_on_device(smollm2, cfg, 4096, 256, CPU)
    assert not steps.fits_on_device(smollm2, dataclasses.replace(cfg, device_caches=False), 4096, 256, gpu(139))


def test_the_memory_plan_uses_the_planned_steps(smollm2, monkeypatch):
    monkeypatch.setattr(devices, "traits", lambda _d: gpu(8))
    job = memplan.Workload.of_build(BuildConfig(), torch.device("cuda"), smollm2)
    assert (job.compensate_batch, job.compensate_final_kl_batch) == (64, 64)
    monkeypatch.undo()
    cpu = memplan.Workload.of_build(BuildConfig(), torch.device("cpu"))
    assert cpu.compensate_batch == CompensateConfig.cpu_batch_size
