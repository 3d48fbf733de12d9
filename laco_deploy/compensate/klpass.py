"""The mechanics of the final KL pass (distill.py) with memory bounded by one layer, not the model.

The whole pruned model trains at once, but it is never held as one autograd graph:
- forward: decoder layer after decoder layer under no_grad, keeping only each layer's input
  ([batch, seq, hidden] per layer: 0.6 MiB at 2 x 128 tokens of width 576);
- the KL to the dense logits on chunks of `sizing.KL_CHUNK_TOKENS` tokens, each chunk's logits made,
  compared and backpropagated to the last hidden state before the next (the full [tokens, vocab]
  logits, ~12 fp32 copies of them with softmax and gradient, are never alive together; a large head
  is cast to the autocast dtype in row blocks, not whole per chunk);
- backward: layer after layer from the last, each recomputed from its saved input with grad
  (activation checkpointing at layer granularity), backpropagated with the gradient of its output,
  its weights stepped by the hooks of distill.StepInBackward as their gradients complete.
So the autograd state is one layer's at a time, which also lets a model streamed from disk train:
each layer is read when reached and, once stepped, spilled back (engine.lazy.LazyModel).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from laco_deploy.engine.walk import call_layer
from laco_deploy.memory import trim_heap
from laco_deploy.models import decoder_layers
from laco_deploy.sizing import KL_CHUNK_TOKENS


class LayerStack:
    """The pruned model's decoder layers, run one at a time on `device` (streamed ones loaded for
    the call and dropped after; `spill` writes a trained one back to disk)."""

    def __init__(self, model, loader: Any, kwargs: list[dict[str, Any]], device: torch.device,
                 amp: Callable[[], contextlib.AbstractContextManager]):
        self.model, self.loader, self.kwargs, self.device, self.amp = model, loader, kwargs, device, amp
        self.layers = decoder_layers(model)

    def __len__(self) -> int:
        return len(self.layers)

    def open(self, i: int) -> torch.nn.Module:
        if self.loader is not None:
            self.loader.load(i, self.layers[i])
        return self.layers[i].to(self.device)

    def close(self, i: int, changed: bool) -> None:
        """Done with layer i for now: a streamed layer goes back to disk (its spill file) if it
        changed, else is simply dropped; a resident one returns to the CPU."""
        layer = self.layers[i].to("cpu")
        if self.loader is None:
            return
        if changed:
            self.loader.release(i, layer)
        else:
            layer.to("meta")
            trim_heap()

    @torch.no_grad()
    def forward(self, hidden: torch.Tensor, keep: bool, start: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden [b, seq, hidden], the input of layer `start`, through it and every later layer ->
        (last hidden, if `keep` each of those layers' input [layers - start, b, seq, hidden]).
        The inputs are copied into one buffer allocated up front: kept as the layers' own outputs,
        each would sit between that layer's freed temporaries, and the heap grew by a layer's
        temporaries per layer (+12 MiB per SmolLM2-135M layer, resident for the whole pass)."""
        saved = hidden.new_empty((len(self) - start, *hidden.shape)) if keep else None
        for i in range(start, len(self)):
            layer = self.open(i)
            if saved is not None:
                saved[i - start].copy_(hidden)
            with self.amp():
                hidden = call_layer(layer, hidden, self.kwargs[i])
            if saved is not None and hidden.dtype != saved.dtype:
                raise AssertionError(f"layer {i} changed the hidden states' dtype ({saved.dtype} -> {hidden.dtype})")
            self.close(i, changed=False)
        return hidden, saved

    def backward(self, saved: torch.Tensor, grad: torch.Tensor, attach: Callable[[int, torch.nn.Module], None],
                 detach: Callable[[int, torch.nn.Module], None], start: int = 0) -> None:
        """Backpropagate `grad` (d loss / d last hidden) layer by layer down to layer `start`,
        recomputing each layer from its input in `saved` (forward's buffer); `attach(i, layer)`
        readies layer i's weights to step in the backward (distill.StepInBackward), `detach` puts
        them back to rest."""
        for i in reversed(range(start, len(self))):
            layer = self.open(i)
            attach(i, layer)
            x = saved[i - start].detach().requires_grad_(i > start)
            with torch.enable_grad(), self.amp():
                out = call_layer(layer, x, self.kwargs[i])
            out.backward(grad.to(out.dtype))
            grad = x.grad if i > start else None
            del x, out
            detach(i, layer)
            self.close(i, changed=True)


# Under autocast a [vocab, hidden] head is cast whole for every call (and kept for its backward): 335 MB
# at Gemma 3's 262k x 640, the final pass's peak. Heads with more rows go HEAD_BLOCK_ROWS rows at a time.
HEAD_BLOCK_ROWS = 65536


class _BlockedHead(torch.autograd.Function):
    """x @ W.T in the autocast dtype, W cast HEAD_BLOCK_ROWS rows at a time in both directions; the
    gradient flows to x only (the head is frozen in the final pass and the guard)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        ctx.save_for_backward(weight)
        ctx.dtype, ctx.x_dtype = dtype, x.dtype
        x = x.to(dtype)
        out = x.new_empty(*x.shape[:-1], weight.shape[0])
        for start in range(0, weight.shape[0], HEAD_BLOCK_ROWS):
            out[..., start:start + HEAD_BLOCK_ROWS] = x @ weight[start:start + HEAD_BLOCK_ROWS].to(dtype).T
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (weight,) = ctx.saved_tensors
        grad_x = None
        for start in range(0, weight.shape[0], HEAD_BLOCK_ROWS):
            part = (grad[..., start:start + HEAD_BLOCK_ROWS].to(ctx.dtype) @ weight[start:start + HEAD_BLOCK_ROWS].to(ctx.dtype)).float()
            grad_x = part if grad_x is None else grad_x.add_(part)
        return grad_x.to(ctx.x_dtype), None, None


def _lm_head(head: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    device = x.device.type
    if head.bias is not None or head.weight.shape[0] <= HEAD_BLOCK_ROWS or not torch.is_autocast_enabled(device):
        return head(x)
    dtype = torch.get_autocast_dtype(device)
    with torch.autocast(device, enabled=False):
        return _BlockedHead.apply(x, head.weight, dtype)


def head_logits(model, hidden: torch.Tensor, softcap: float | None, *, norm: bool = True) -> torch.Tensor:
    """Last hidden states (before the final norm, or after it with norm=False) through the model's
    own final norm, LM head and soft-capping. [..., hidden] -> [..., vocab]."""
    logits = _lm_head(model.lm_head, model.model.norm(hidden) if norm else hidden)
    return torch.tanh(logits / softcap) * softcap if softcap is not None else logits


def _kl_sum(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Sum over tokens of KL(teacher || student). [tokens, vocab] x2 -> scalar."""
    s = torch.log_softmax(student.float(), dim=-1)
    t = torch.log_softmax(teacher.float(), dim=-1)
    return torch.nn.functional.kl_div(s, t, log_target=True, reduction="sum")


def kl_to_teacher(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of KL(teacher || student). [b, seq, vocab] x2 -> scalar."""
    return _kl_sum(student.flatten(0, -2), teacher.flatten(0, -2)) / student.shape[:-1].numel()


def chunked_kl(model, hidden: torch.Tensor, teacher: torch.Tensor, softcap: float | None,
               amp: Callable[[], contextlib.AbstractContextManager], want_grad: bool,
               chunk: int = KL_CHUNK_TOKENS) -> tuple[float, torch.Tensor | None]:
    """Mean token KL(dense || pruned) of last hidden states `hidden` against the dense ones `teacher`
    (both [b, seq, hidden]), made `chunk` tokens at a time; with `want_grad` also its gradient with
    respect to `hidden` (the head and norm are frozen). Returns (mean KL, grad or None)."""
    flat, dense = hidden.detach().flatten(0, 1), teacher.flatten(0, 1)
    grad = torch.zeros_like(flat) if want_grad else None
    total, tokens = 0.0, flat.shape[0]
    for start in range(0, tokens, chunk):
        stop = min(start + chunk, tokens)
        with torch.no_grad(), amp():
            target = head_logits(model, dense[start:stop], softcap)
        piece = flat[start:stop].clone().requires_grad_(want_grad)
        with torch.set_grad_enabled(want_grad):
            with amp():
                student = head_logits(model, piece, softcap)
            loss = _kl_sum(student, target) / tokens
        if want_grad:
            loss.backward()
            grad[start:stop] = piece.grad
        total += float(loss.detach())
        del target, student, loss, piece
    return total, (grad.view_as(hidden) if want_grad else None)
