"""Checks run right after an ONNX export: onnxruntime against PyTorch on evaluation tokens.

Parity: the PyTorch model scores `prefill + decode` tokens in one forward (no cache); the ONNX
graph prefills the first `prefill` tokens with an empty past, then decodes the rest one token
at a time from its own key/value cache (teacher forcing). Every position's logits are compared.
Greedy: both generate the same number of tokens greedily from a short prompt.
"""

from __future__ import annotations

import numpy as np
import torch


def logit_parity(model, decoder, tokens: torch.Tensor, prefill: int) -> dict:
    """model: PyTorch causal LM (reference), decoder: laco_deploy.bench.onnxrt.OrtDecoder,
    tokens [prefill + decode] int64 -> max |diff| and top-1 agreement, prefill and decode apart."""
    with torch.no_grad():
        ref = model(tokens.view(1, -1), use_cache=False).logits[0].float().numpy()  # [n, vocab]
    ids = tokens.numpy().astype(np.int64)
    pre_logits, past = decoder.prefill(ids[:prefill])  # [prefill, vocab]
    steps = []
    for pos in range(prefill, ids.shape[0]):
        step_logits, past = decoder.step(int(ids[pos]), pos, past)
        steps.append(step_logits)
    got = np.concatenate([pre_logits, np.stack(steps)]) if steps else pre_logits
    diff = np.abs(got - ref)
    top1 = got.argmax(-1) == ref.argmax(-1)
    return {
        "prefill_tokens": int(prefill),
        "decode_steps": len(steps),
        "max_abs_logit_diff": float(diff.max()),
        "max_abs_diff_prefill": float(diff[:prefill].max()),
        "max_abs_diff_decode": float(diff[prefill:].max()) if steps else None,
        "mean_abs_logit_diff": float(diff.mean()),
        "top1_agreement": float(top1.mean()),
        "top1_agreement_decode": float(top1[prefill:].mean()) if steps else None,
    }


def torch_greedy(model, prompt: torch.Tensor, new_tokens: int) -> list[int]:
    """Greedy continuation in PyTorch with transformers' own KV cache: prompt [seq] -> ids."""
    with torch.no_grad():
        out = model.generate(prompt.view(1, -1), attention_mask=torch.ones(1, prompt.numel(), dtype=torch.long),
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             num_beams=1, pad_token_id=0)
    return out[0, prompt.numel():].tolist()


def greedy_match(model, decoder, prompt: torch.Tensor, new_tokens: int) -> dict:
    """Generate `new_tokens` greedily in PyTorch and onnxruntime from the same prompt [seq]."""
    ref = torch_greedy(model, prompt, new_tokens)
    got = decoder.generate(prompt.numpy().astype(np.int64), new_tokens, eos_token_id=None)
    same = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), len(ref))
    return {"prompt_tokens": int(prompt.numel()), "new_tokens": new_tokens, "identical": ref == got,
            "matching_prefix": same}
