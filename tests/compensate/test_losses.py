"""The loss, mask, schedule and accounting math on tiny tensors, against the formulas."""

from __future__ import annotations

import time

import pytest
import torch

from laco_deploy.compensate import losses
from laco_deploy.compensate.budget import resolve_budget
from laco_deploy.compensate.masks import MaskFactors, masked_merge, weight_mask
from laco_deploy import devices
from laco_deploy.compensate.train import amp_dtype, cosine_lr, resolve_precision, split_indices
from laco_deploy.compensate.workingset import count_saved, working_set
from laco_deploy.config import CompensateConfig, DataConfig
from laco_deploy.memory import SAMPLE_S


def _pair(seed=0):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(2, 3, 5, generator=g)
    return t + 0.1 * torch.randn(2, 3, 5, generator=g), t


def test_mse_and_nmse_match_formulas():
    p, t = _pair()
    assert torch.allclose(losses.mse(p, t), ((p - t) ** 2).sum() / p.numel())
    manual = sum(((p[b, s] - t[b, s]) ** 2).sum() / (t[b, s] ** 2).sum() for b in range(2) for s in range(3)) / 6
    assert torch.allclose(losses.nmse(p, t), manual)


def test_nmse_is_per_token_scale_free_but_mse_is_not():
    p, t = _pair(1)
    p2, t2 = p.clone(), t.clone()
    p2[0, 0] *= 1000.0  # a massive-activation token
    t2[0, 0] *= 1000.0
    assert torch.allclose(losses.nmse(p2, t2), losses.nmse(p, t), rtol=1e-4)
    assert losses.mse(p2, t2) > 1000 * losses.mse(p, t)


def test_channel_nmse_matches_its_formula():
    p, t = _pair(2)
    scale = (t ** 2).mean((0, 1))  # [h]: each channel's mean square over the batch's tokens
    manual = sum(((p[..., c] - t[..., c]) ** 2).mean() / scale[c] for c in range(5)) / 5
    assert torch.allclose(losses.channel_nmse(p, t), manual)
    assert losses.channel_nmse(t, t) == 0


def test_channel_nmse_sees_small_channels_next_to_a_massive_one():
    """Issue 31 (Gemma 3): one channel ~1000x the others at every token. nmse is that channel's error
    alone, so a 10% error on every small channel barely moves it; channel_nmse weighs each channel by
    its own scale, so it is unchanged by the massive channel and shows the small channels' error."""
    p, t = _pair(3)
    t[..., 0] *= 1000.0
    p[..., 0] = t[..., 0]
    small = p.clone()
    small[..., 1:] = t[..., 1:] * 1.1
    exact = t.clone()
    assert losses.nmse(small, t) < 1e-5  # blind to the small channels
    assert losses.channel_nmse(small, t) > 0.99 * 0.01 * 4 / 5  # 10% on 4 of 5 channels
    assert losses.channel_nmse(exact, t) == 0
    scaled = t.clone()
    scaled[..., 0] *= 7.0  # a channel's scale does not change its weight
    p2 = small.clone()
    p2[..., 0] *= 7.0
    assert torch.allclose(losses.channel_nmse(p2, scaled), losses.channel_nmse(small, t))


def test_channel_nmse_is_a_compensate_loss():
    assert not CompensateConfig(loss="channel_nmse").validate()
    assert losses.get_loss("channel_nmse") is losses.channel_nmse


def test_cos_mse_formula_and_zero_at_target():
    p, t = _pair(2)
    cos = (p * t).sum(-1) / (p.norm(dim=-1) * t.norm(dim=-1))
    expected = (1 - cos).mean() + ((p - t) ** 2).mean() / (t ** 2).mean()
    assert torch.allclose(losses.cos_mse(p, t), expected, atol=1e-6)
    assert losses.cos_mse(t, t).abs() < 1e-6


def test_cos_mse_split_batch_with_the_whole_batch_scale_equals_the_whole():
    """What a torchrun rank computes: its rows' cos_mse with the whole batch's scale (from per-sample
    energies), weighted by its share of the batch; the parts add up to the one-process loss."""
    p, t = _pair(5)
    scale = losses.mean_square(losses.sample_energy(t), t[0].numel())
    assert scale == pytest.approx(float((t.double() ** 2).mean()), rel=1e-12)
    assert torch.allclose(losses.cos_mse(p, t, scale), losses.cos_mse(p, t), atol=1e-6)
    parts = sum(losses.cos_mse(p[i:i + 1], t[i:i + 1], scale) * 0.5 for i in range(2))
    assert torch.allclose(parts, losses.cos_mse(p, t), atol=1e-6)
    own = sum(losses.cos_mse(p[i:i + 1], t[i:i + 1]) * 0.5 for i in range(2))  # each part's own scale
    assert not torch.allclose(own, losses.cos_mse(p, t), atol=1e-4)


def test_subblock_sums_both_parts():
    p, t = _pair(3)
    q, u = _pair(4)
    assert torch.allclose(losses.subblock_loss(p, t, q, u), losses.nmse(p, t) + losses.nmse(q, u))
    with pytest.raises(KeyError):
        losses.get_loss("l1")


def test_mask_factors_zero_grads_and_write_positive_zeros():
    w = torch.tensor([[1.0, 0.0, -2.0], [0.0, 3.0, 0.0]])
    mask = weight_mask(w)
    holder = torch.nn.Module()
    holder.proj = torch.nn.Linear(3, 2, bias=False)
    with torch.no_grad():
        holder.proj.weight.copy_(torch.tensor([[5.0, -7.0, 1.0], [-1.0, 2.0, -3.0]]))  # negatives where masked
    holder.proj.weight.grad = torch.full((2, 3), -0.5)
    factors = MaskFactors(holder, {"proj": mask})
    factors.zero_grads()
    assert torch.equal(holder.proj.weight.grad != 0, mask)
    factors.apply()
    assert torch.equal(holder.proj.weight != 0, mask)
    assert torch.equal(holder.proj.weight[mask], torch.tensor([5.0, 1.0, 2.0]))
    assert not torch.signbit(holder.proj.weight[~mask]).any()  # -7 * 0 is -0.0; the write makes it +0.0


def test_masked_merge_counts_lost_zeros():
    w = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    delta = torch.tensor([[0.5, 0.25], [0.0, -1.0]])
    merged, lost = masked_merge(w, delta)
    assert torch.equal(merged, torch.tensor([[1.5, 0.0], [0.0, 1.0]]))
    assert lost == 1  # only position (0, 1): a zero that the delta would have filled


def test_cosine_schedule_and_split():
    assert cosine_lr(0, 100, 10) == pytest.approx(0.1)
    assert cosine_lr(10, 100, 10) == pytest.approx(1.0)
    assert cosine_lr(55, 100, 10) == pytest.approx(0.5)
    assert cosine_lr(100, 100, 10) == pytest.approx(0.0, abs=1e-12)
    tr, va = split_indices(16, 0.125, 0)
    assert len(va) == 2 and len(tr) == 14 and set(tr.tolist()).isdisjoint(va.tolist())
    assert torch.equal(split_indices(16, 0.125, 0)[1], va)
    assert len(split_indices(16, 0.0, 0)[1]) == 0


def test_saved_activation_count_excludes_parameters():
    lin = torch.nn.Linear(8, 4, bias=False)
    x = torch.randn(3, 8, requires_grad=False)
    with count_saved(lin.parameters()) as meter:
        y = torch.relu(lin(x))
    # linear saves x (3*8 floats); relu saves its output (3*4 floats); the weight is not counted
    assert meter.bytes == (3 * 8 + 3 * 4) * 4
    ws = working_set(list(lin.parameters()), list(lin.parameters()), meter.bytes, [x])
    assert ws["optimizer"] == 2 * ws["grads"] == 2 * 32 * 4
    assert ws["total"] == sum(v for k, v in ws.items() if k != "total")
    y.sum().backward()


def test_budget_resolution_in_one_place():
    data = DataConfig(seqlen=128)
    cpu = resolve_budget(CompensateConfig(), data, torch.device("cpu"))
    assert cpu.samples == CompensateConfig.cpu_samples and "small CPU budget" in cpu.note
    assert cpu.seqlen == min(128, CompensateConfig.cpu_seqlen)
    assert resolve_budget(CompensateConfig(), DataConfig(seqlen=64), torch.device("cpu")).seqlen == 64
    assert resolve_budget(CompensateConfig(samples=8), DataConfig(seqlen=512), torch.device("cpu")).seqlen == 512
    gpu = resolve_budget(CompensateConfig(), data, torch.device("cuda"))
    assert gpu.samples == 2048 and gpu.seqlen == 128
    explicit = resolve_budget(CompensateConfig(samples=7), data, torch.device("cuda"))
    assert explicit.samples == 7 and explicit.source == "explicit"


def test_segment_meter_keeps_the_peak_of_earlier_segments():
    from laco_deploy.compensate.laco import SegmentMeter

    meter = SegmentMeter(torch.device("cpu"))
    meter.next()
    big = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    # held for several sampling periods: below an earlier all-time peak only the sampler sees it, and on
    # a loaded machine its thread can miss a block freed at once (a full run beside a build saw 45 MiB)
    time.sleep(10 * SAMPLE_S)
    del big
    meter.next()  # resets the counter; the first segment's peak must survive
    small = torch.ones(1024)
    meter.close()
    assert small.sum() == 1024
    assert len(meter.done) == 2
    assert meter.peak_delta_bytes >= 60 * 2**20
    assert meter.done[1].peak_delta_bytes < 32 * 2**20


def test_precision_resolves_by_device_and_cpu(monkeypatch):
    cpu = torch.device("cpu")
    for explicit in ("fp32", "bf16", "fp16"):
        assert resolve_precision(explicit, cpu) == explicit
    monkeypatch.setattr(devices, "cpu_has_native_bf16", lambda: True)
    assert resolve_precision("auto", cpu) == "bf16" and amp_dtype(cpu, "auto") is torch.bfloat16
    monkeypatch.setattr(devices, "cpu_has_native_bf16", lambda: False)
    assert resolve_precision("auto", cpu) == "fp32" and amp_dtype(cpu, "auto") is None
    # a GPU: bf16 where native, else fp16 (with loss scaling), never fp32
    for bf16, want in ((True, "bf16"), (False, "fp16")):
        monkeypatch.setattr(devices, "traits", lambda _d, b=bf16: devices.Traits(True, b, 2**34))
        assert resolve_precision("auto", cpu) == want
    assert "compensate.precision 'fp8'" in " ".join(CompensateConfig(precision="fp8").validate())


def test_the_family_names_the_loss_when_the_user_does_not():
    from laco_deploy import families

    assert CompensateConfig().loss is None and not CompensateConfig().validate()
    assert families.layer_loss({"architectures": ["Gemma3ForCausalLM"]}) == "channel_nmse"
    assert families.layer_loss({"model_type": "gemma2"}) == "channel_nmse"
    assert families.layer_loss({"architectures": ["LlamaForCausalLM"]}) == "nmse"
    assert families.layer_loss({"architectures": ["Unknown"]}) == "nmse"
    assert CompensateConfig(loss="bogus").validate()


def test_the_family_names_the_learning_rate_when_the_user_does_not(tiny_gemma3_dir):
    """Gemma's linears are ~5x smaller than SmolLM2's: 3e-4 unless the user names a rate; a direct
    caller (not the stage) gets it from the layer, and an explicit rate always wins."""
    from laco_deploy import families
    from laco_deploy.compensate.laco import layer_lr
    from laco_deploy.models import load_model

    assert CompensateConfig().lr is None and not CompensateConfig().validate()
    assert families.layer_lr({"architectures": ["Gemma3ForCausalLM"]}) == 3e-4
    assert families.layer_lr({"model_type": "gemma2"}) == 3e-4
    assert families.layer_lr({"architectures": ["LlamaForCausalLM"]}) == 3e-3
    assert families.layer_lr({"architectures": ["Unknown"]}) == 3e-3
    layer = load_model(str(tiny_gemma3_dir)).model.model.layers[0]
    assert layer_lr(CompensateConfig(), 0, 6, layer) == 3e-4
    assert layer_lr(CompensateConfig(lr=1e-3), 0, 6, layer) == 1e-3
    assert layer_lr(CompensateConfig(lr_last_factor=0.5), 5, 6, layer) == pytest.approx(1.5e-4)
    assert CompensateConfig(lr=0.0).validate() and CompensateConfig(lr=-1e-3).validate()
