"""CUDA's choices driven on a CPU, for every supported family: prune, LaCo (walk and final KL pass),
the LoRA baseline and fidelity run to the end.

What a CUDA run chooses differently comes from `devices.traits` (precision `auto` -> bf16, or fp16
with loss scaling; the paper's budget; device-sized steps; device-resident caches): here it answers
as a GPU does, so the same code takes CUDA's branches. Attention goes through sdpa with
`enable_gqa=True`, as transformers calls it without a mask on any device; and torch's FLOP counter
is made to see it as torch 2.11's does on CUDA, whose formula asserts on grouped-query shapes (CPU's
fused kernel has no formula at all, so on CPU nothing failed). Before issue 27 that assertion ended
the LaCo run in its first step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.utils import flop_counter

import tiny
from laco_deploy import devices
from laco_deploy.compensate import run as compensate
from laco_deploy.data import builtin_path
from laco_deploy.config import CompensateConfig, DataConfig, FidelityConfig, ModelConfig, PruneConfig
from laco_deploy.fidelity import run as fidelity
from laco_deploy.prune import run as prune

aten = torch.ops.aten
FAMILIES = {"llama": tiny.llama_config, "mistral": tiny.mistral_config, "qwen2": tiny.qwen2_config,
            "qwen3": tiny.qwen3_config, "gemma2": tiny.gemma2_config, "gemma3": tiny.gemma3_config,
            "phi3": tiny.phi3_config, "smollm3": tiny.smollm3_config}
EAGER = {"gemma2"}  # transformers runs Gemma 2's soft-capped attention eagerly, on CUDA too


def _torch_211_sdpa_count(query_shape, key_shape, value_shape, *_a):
    """torch 2.11's check: key/value must have the query's heads."""
    if query_shape[1] != key_shape[1]:
        raise AssertionError(f"sdpa_flop_count: query/key/value shapes are incompatible: q={query_shape}, k={key_shape}")
    return 0


def _cuda_choices(monkeypatch, precision: str) -> dict:
    """Traits of a GPU (bf16, or fp16 where bf16 is not native), torch 2.11's attention FLOP formulas
    for the attention kernel, and a record of the sdpa calls and of the loss scalers made."""
    bf16 = precision == "bf16"
    monkeypatch.setattr(devices, "traits", lambda _device: devices.Traits(True, bf16, 16 * 2**30))
    monkeypatch.setattr(flop_counter, "sdpa_flop_count", _torch_211_sdpa_count)
    monkeypatch.setattr(flop_counter, "sdpa_backward_flop_count", lambda g, q, k, v: _torch_211_sdpa_count(q, k, v))
    # CPU's kernel counted as CUDA's flash kernel is (torch has no formula for it)
    monkeypatch.setitem(flop_counter.flop_registry, aten._scaled_dot_product_flash_attention_for_cpu, flop_counter.sdpa_flop)
    monkeypatch.setitem(flop_counter.flop_registry, aten._scaled_dot_product_flash_attention_for_cpu_backward,
                        flop_counter.sdpa_backward_flop)
    seen = {"precision": precision, "gqa": 0, "sdpa": 0, "scalers": []}
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen["sdpa"] += 1
        seen["gqa"] += bool(kwargs.get("enable_gqa"))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    scaler = torch.amp.GradScaler

    class Recorded(scaler):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            seen["scalers"].append(self.is_enabled())

    monkeypatch.setattr(torch.amp, "GradScaler", Recorded)
    return seen


@pytest.fixture()
def as_on_cuda(monkeypatch, request) -> dict:
    return _cuda_choices(monkeypatch, request.param)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> DataConfig:
    """A short text (the builtin one is tokenized whole: seconds per stage)."""
    text = tmp_path_factory.mktemp("cuda_paths_text") / "text.txt"
    text.write_text(builtin_path("calib").read_text(encoding="utf-8")[:20_000], encoding="utf-8")
    return DataConfig(calib=str(text), eval=str(text), samples=4, seqlen=32, eval_samples=2, seed=0)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory, bpe_tokenizer, data) -> tuple[str, Path, Path]:
    """(family, dense dir, its Wanda-pruned dir): pruned with a GPU's traits and torch 2.11's counter."""
    name = request.param
    work = tmp_path_factory.mktemp(f"cuda_paths_{name}")
    dense = tiny.save_tiny(tiny.build_model(FAMILIES[name](), seed=11), bpe_tokenizer, work / "dense")
    with pytest.MonkeyPatch.context() as mp:
        seen = _cuda_choices(mp, "bf16")
        prune(ModelConfig(model=str(dense), device="cpu"), data, PruneConfig(method="wanda"), work / "pruned")
    assert name in EAGER or seen["gqa"] > 0, "pruning never ran grouped-query sdpa"
    return name, dense, work / "pruned"


def _comp(method: str) -> CompensateConfig:
    # precision auto: what a GPU resolves it to; 8 walk samples (+4 for the final pass)
    return CompensateConfig(method=method, samples=8, epochs=1, final_kl_epochs=1, final_kl_samples=4,
                            val_fraction=0.25)


@pytest.mark.parametrize("as_on_cuda", ["bf16", "fp16"], indirect=True)
def test_compensation_runs_with_cuda_choices(family, data, as_on_cuda, tmp_path):
    """LaCo (walk and final KL pass) and LoRA, in bf16, and in fp16 with loss scaling; then fidelity
    (which computes in fp32 on any device: once)."""
    name, dense, pruned = family
    model = ModelConfig(model=str(dense), device="cpu")
    want = as_on_cuda["precision"]
    laco = compensate(model, data, _comp("laco"), pruned, tmp_path / "laco")
    assert laco.settings["compensate"]["precision"] == want
    assert laco.settings["budget"]["samples"] == 8 and laco.settings["final_kl"]["steps"] > 0
    # the attention kernel's count came from laco_deploy.flops despite torch 2.11's formula
    assert laco.settings["throughput"]["gflop"] > 0
    assert "on the accelerator" in " ".join(laco.notes)
    lora = compensate(model, data, _comp("lora"), pruned, tmp_path / "lora")
    assert lora.settings["throughput"]["gflop"] > 0
    # fp16: every trainer scaled its loss (the final pass runs fp32: its steps live inside the backward)
    assert as_on_cuda["scalers"] and all(s == (want == "fp16") for s in as_on_cuda["scalers"])
    if name not in EAGER:
        assert as_on_cuda["gqa"] > 0, "attention never ran grouped-query sdpa"
    if want == "bf16":
        report = fidelity(model, data, FidelityConfig(), {"laco": tmp_path / "laco", "lora": tmp_path / "lora"},
                          tmp_path / "report")
        assert set(report.candidates) == {"laco", "lora"}
        assert json.loads((tmp_path / "report" / "fidelity.json").read_text())["candidates"]
