"""The bounded final KL pass's mechanics (compensate/klpass.py): the chunked KL and its gradient equal
the full-logits ones, and with AdamW the layer-at-a-time pass equals a plain whole-model pass (one
autograd graph, full logits, every weight stepped after the backward)."""

from __future__ import annotations

import contextlib
import copy

import torch

from laco_deploy import distributed
from laco_deploy.compensate import distill, klpass
from laco_deploy.compensate.train import cosine_lr
from laco_deploy.config import PRUNABLE_LINEARS, CompensateConfig
from laco_deploy.data import calibration_samples
from laco_deploy.engine import capture_layer_inputs
from laco_deploy.models import decoder_layers, linear_modules, load_model

CPU = torch.device("cpu")


def _kl_full(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    s = torch.log_softmax(student.float(), -1).flatten(0, 1)
    t = torch.log_softmax(teacher.float(), -1).flatten(0, 1)
    return torch.nn.functional.kl_div(s, t, log_target=True, reduction="batchmean")


def test_chunked_kl_and_gradient_equal_the_full_logits(sparse_unstructured_dir):
    model = load_model(str(sparse_unstructured_dir)).model
    torch.manual_seed(0)
    hidden = torch.randn(3, 7, model.config.hidden_size, requires_grad=True)
    teacher = torch.randn(3, 7, model.config.hidden_size)
    full = _kl_full(klpass.head_logits(model, hidden, None), klpass.head_logits(model, teacher, None))
    full.backward()
    for chunk in (1, 5, 32):  # uneven chunks, one chunk
        kl, grad = klpass.chunked_kl(model, hidden, teacher, None, contextlib.nullcontext, True, chunk=chunk)
        assert abs(kl - float(full)) < 1e-5
        assert torch.allclose(grad, hidden.grad, atol=1e-7, rtol=1e-5)
    kl, grad = klpass.chunked_kl(model, hidden, teacher, 30.0, contextlib.nullcontext, False, chunk=4)  # softcapped
    capped = _kl_full(klpass.head_logits(model, hidden, 30.0), klpass.head_logits(model, teacher, 30.0))
    assert grad is None and abs(kl - float(capped)) < 1e-5


def _reference_pass(model, ids, teacher, cfg, train_idx, seed):
    """A plain whole-model pass: full logits, one backward, then every weight stepped (AdamW)."""
    params = [lin.weight for layer in decoder_layers(model) for lin in linear_modules(layer, PRUNABLE_LINEARS).values()]
    masks = [(p != 0).float() for p in params]
    opts = [torch.optim.AdamW([p], lr=0.0, weight_decay=0.0) for p in params]
    for p in params:
        p.requires_grad_(True)
    order = train_idx[torch.randperm(len(train_idx), generator=torch.Generator().manual_seed(seed))]
    total = -(-len(train_idx) // cfg.batch_size) * cfg.final_kl_epochs
    for step, chunk in enumerate(order.split(cfg.batch_size)):
        lr = cfg.kl_lr * cosine_lr(step, total, int(total * cfg.warmup_fraction))
        with torch.no_grad():
            target = klpass.head_logits(model, teacher[chunk], None)
        _kl_full(model(ids[chunk], use_cache=False).logits, target).backward()
        with torch.no_grad():
            for p, mask, opt in zip(params, masks, opts):
                p.grad.mul_(mask)
                opt.param_groups[0]["lr"] = lr
                opt.step()
                p.grad = None
                p.mul_(mask)


def test_bounded_pass_equals_a_whole_model_pass(tiny_llama_dir, sparse_unstructured_dir):
    dense, pruned = load_model(str(tiny_llama_dir)), load_model(str(sparse_unstructured_dir))
    model, ref = pruned.model, copy.deepcopy(pruned.model)
    ids = calibration_samples(pruned.tokenizer, "builtin", 16, 32, 0)
    teacher = distill.dense_teacher(dense.model, None, capture_layer_inputs(model, ids, CPU), CPU, 4, None)
    inputs = capture_layer_inputs(model, ids, CPU)
    cfg = CompensateConfig(final_kl_optimizer="adamw", final_kl_lr=1e-3, batch_size=4, precision="fp32")
    split = (torch.arange(12), torch.arange(12, 16))
    final = distill.final_kl(model, inputs.hidden, teacher, cfg, PRUNABLE_LINEARS, split, device=CPU,
                             kwargs=inputs.kwargs_per_layer(len(decoder_layers(model)), CPU), seed=0,
                             shard=distributed.shard(16), restore=lambda i, layer: None)
    assert final["steps"] == 3 and final["optimizer_state_mib"] > 0
    _reference_pass(ref, ids, teacher.data, cfg, split[0], 0)
    a, b = model.state_dict(), ref.state_dict()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=2e-6, rtol=1e-4), k
        assert torch.equal(a[k] == 0, b[k] == 0), k
    assert not torch.equal(a["model.layers.0.mlp.down_proj.weight"],
                           load_model(str(sparse_unstructured_dir)).model.state_dict()["model.layers.0.mlp.down_proj.weight"])


def test_only_the_first_step_maps_its_allocations(tiny_llama_dir, sparse_unstructured_dir, monkeypatch):
    """The first step makes the optimizer state between the backward's temporaries (distill._train)."""
    entered = []

    @contextlib.contextmanager
    def record(threshold):
        entered.append(threshold)
        yield

    monkeypatch.setattr(distill, "mapped_allocations", record)
    dense, pruned = load_model(str(tiny_llama_dir)), load_model(str(sparse_unstructured_dir))
    model = pruned.model
    ids = calibration_samples(pruned.tokenizer, "builtin", 12, 32, 0)
    teacher = distill.dense_teacher(dense.model, None, capture_layer_inputs(model, ids, CPU), CPU, 4, None)
    inputs = capture_layer_inputs(model, ids, CPU)
    cfg = CompensateConfig(final_kl_optimizer="adafactor", batch_size=4, precision="fp32")
    final = distill.final_kl(model, inputs.hidden, teacher, cfg, PRUNABLE_LINEARS, (torch.arange(8), torch.arange(8, 12)),
                             device=CPU, kwargs=inputs.kwargs_per_layer(len(decoder_layers(model)), CPU), seed=0,
                             shard=distributed.shard(12), restore=lambda i, layer: None)
    assert final["steps"] > 1 and entered == [distill.FIRST_STEP_MMAP]


def test_a_large_head_under_autocast_is_cast_in_row_blocks(sparse_unstructured_dir, monkeypatch):
    """A head with more than HEAD_BLOCK_ROWS rows (Gemma 3's 262k) is cast a block of rows at a time,
    forward and backward, instead of whole per call: the logits equal autocast's whole-matrix ones and
    the gradient to the hidden states matches the fp32 one as closely as autocast's does."""
    model = load_model(str(sparse_unstructured_dir)).model.requires_grad_(False)
    monkeypatch.setattr(klpass, "HEAD_BLOCK_ROWS", 7)  # uneven blocks of the tiny vocabulary
    torch.manual_seed(0)
    x = torch.randn(2, 5, model.config.hidden_size)
    grad = torch.randn(2, 5, model.config.vocab_size)
    outs = {}
    for name, fn in {"whole": model.lm_head, "blocked": lambda h: klpass._lm_head(model.lm_head, h)}.items():
        h = x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = fn(h)
        logits.float().backward(grad)
        outs[name] = (logits, h.grad)
    assert outs["blocked"][0].dtype == torch.bfloat16
    assert torch.allclose(outs["blocked"][0].float(), outs["whole"][0].float(), atol=1e-2, rtol=1e-2)
    exact = grad @ model.lm_head.weight  # the fp32 gradient
    err = {k: (g - exact).abs().max().item() for k, (_, g) in outs.items()}
    assert err["blocked"] <= err["whole"] + 1e-6, err
    h = x.clone()
    assert torch.equal(klpass._lm_head(model.lm_head, h), model.lm_head(h))  # no autocast: the plain head
