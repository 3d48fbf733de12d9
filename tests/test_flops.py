"""laco_deploy.flops: attention counted from its shapes (grouped-query too), and a counter that fails
never changes or ends the step it measures."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode

from laco_deploy import flops

Q, KV = (2, 8, 32, 16), (2, 2, 32, 16)  # 8 query heads share 2 key/value heads


def _attention_step(gqa: bool = True) -> tuple[torch.Tensor, ...]:
    """sdpa as transformers calls it (enable_gqa), forward and backward; returns the gradients."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(*Q, generator=gen, requires_grad=True)
    k = torch.randn(*(KV if gqa else Q), generator=gen, requires_grad=True)
    v = torch.randn(*(KV if gqa else Q), generator=gen, requires_grad=True)
    F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa).square().sum().backward()
    return q.grad, k.grad, v.grad


def test_formulas_count_every_query_head():
    b, h, s, d = Q
    assert flops.attention_flops(Q, KV, KV) == 2 * (2 * b * h * s * s * d)  # Q K^T and P V
    assert flops.attention_backward_flops(Q, Q, KV, KV) == 5 * (2 * b * h * s * s * d)
    assert flops.attention_flops(Q, KV, KV) == flops.attention_flops(Q, Q, Q)  # grouping saves memory, not FLOPs


def test_cpu_fused_attention_is_counted():
    """torch has no formula for CPU's fused kernel (it counted 0); ours counts it, grouped or not."""
    for gqa in (True, False):
        with flops.StepFlops() as c:
            _attention_step(gqa)
        assert c.error is None
        assert c.total == flops.attention_flops(Q, KV, KV) + flops.attention_backward_flops(Q, Q, KV, KV)


def test_a_formula_that_raises_is_not_counted_and_the_step_is_unchanged(monkeypatch):
    """torch 2.11 on CUDA: its sdpa formula asserts on grouped-query shapes inside the forward pass."""
    def asserts(*_a, **_k):
        raise AssertionError("sdpa_flop_count: query/key/value shapes are incompatible")

    monkeypatch.setattr(flops, "_forward", asserts)
    want = _attention_step()
    with flops.StepFlops() as c:
        got = _attention_step()
    assert c.total is None and "incompatible" in c.error
    assert all(torch.equal(a, b) for a, b in zip(want, got))


def test_torch_formulas_that_raise_are_guarded_too(monkeypatch):
    monkeypatch.setitem(flop_counter.flop_registry, torch.ops.aten.mm, lambda *_a, **_k: 1 / 0)
    with flops.StepFlops() as c:
        torch.randn(4, 4) @ torch.randn(4, 4)
    assert c.total is None and "ZeroDivisionError" in c.error


class _Breaks(TorchDispatchMode):
    """Fails on the 20th operation it sees."""

    calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        _Breaks.calls += 1
        if _Breaks.calls == 20:
            raise RuntimeError("counter broke")
        return func(*args, **(kwargs or {}))


class _BrokenCounter(flop_counter.FlopCounterMode):
    """A counter whose dispatch itself fails halfway through a step (not a formula)."""

    def __enter__(self):
        self.breaks = _Breaks()
        self.breaks.__enter__()
        return self

    def __exit__(self, *exc):
        self.breaks.__exit__(*exc)
        return False


def test_counted_reruns_a_step_the_counter_broke(monkeypatch):
    layer = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
    params = list(layer.parameters())
    x = torch.randn(4, 8)

    def step() -> torch.Tensor:
        loss = layer(x).square().mean()
        loss.backward()
        return loss.detach()

    step()
    want = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    monkeypatch.setattr(flops, "FlopCounterMode", _BrokenCounter)
    _loss, counted = flops.counted(step, params)
    assert counted is None and _Breaks.calls >= 20
    assert all(torch.equal(p.grad, g) for p, g in zip(params, want))  # not accumulated twice


def test_a_step_that_fails_by_itself_still_raises():
    with pytest.raises(ValueError, match="the step's own"):
        flops.counted(lambda: (_ for _ in ()).throw(ValueError("the step's own")), [])
