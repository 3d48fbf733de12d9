"""Parity checks run right after an export: the exported model on its runtime against PyTorch.

They live beside the runners, not in exporters/, so the exporters depend on nothing that runs
models: targets.py hands each exporter its check (`check=`), and the exporter calls it on what
it just wrote.

GGUF (`gguf_parity`): llama.cpp and PyTorch score the first window of the builtin evaluation
text, fed the same token ids; the two tokenizers are compared too.
ONNX (`onnx_parity`): the PyTorch model scores `prefill + decode` tokens in one forward (no
cache); the ONNX graph prefills the first `prefill` tokens with an empty past, then decodes the
rest one token at a time from its own key/value cache (teacher forcing). Every position's
logits are compared. Greedy: both generate the same number of tokens from a short prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NamedTuple

import numpy as np
import torch

from exporters.onnx_genai import GENAI_FILE
from laco_deploy.divergence import token_kl
from laco_deploy.memory import trim_heap

PARITY_TOKENS = 128  # GGUF: tokens of evaluation text compared right after export (a fixed check, not a setting)
PARITY_PREFILL, PARITY_DECODE = 128, 16  # ONNX: evaluation tokens prefilled, then decoded one by one
GREEDY_PROMPT, GREEDY_NEW = 16, 16  # ONNX: prompt tokens and greedily generated tokens compared


def logit_agreement(ref: torch.Tensor, cand: torch.Tensor) -> dict[str, float]:
    """Top-1 agreement and mean KL(ref || cand) in nats over positions. ref, cand: [seq, vocab].
    KL in float64 row chunks (divergence.token_kl): a full [seq, vocab] float64 pass would
    be the export's largest allocation."""
    kl = token_kl(ref, cand)  # [seq]
    top1 = (ref.argmax(-1) == cand.argmax(-1)).double().mean()
    return {"top1": float(top1), "mean_kl": float(kl.mean()), "max_kl": float(kl.max())}


def gguf_parity(model_dir: Path, gguf_path: Path, n_tokens: int = PARITY_TOKENS) -> dict[str, Any]:
    """llama.cpp vs PyTorch next-token logits on the same evaluation tokens, and tokenizer agreement."""
    from laco_deploy.runtimes.llamacpp import LlamaCppRunner
    from laco_deploy.data import evaluation_stream, load_texts
    from laco_deploy.engine.forward import model_logits
    from laco_deploy.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    stream = evaluation_stream(tokenizer, "builtin", max_tokens=n_tokens)
    # the PyTorch reference runs on the layer engine (one decoder layer in memory), before llama.cpp loads
    ref = model_logits(model_dir, stream, torch.device("cpu"))
    runner = LlamaCppRunner(gguf_path, threads=1, n_ctx=max(n_tokens, 16))  # a check, not a speed run: 1 thread is robust on busy machines
    try:
        cand = runner.logits(stream)
        out = {f"parity_{k}": round(v, 8) for k, v in logit_agreement(ref, cand).items()}
        out["parity_tokens"] = int(stream.numel())
        text = load_texts("builtin", "eval")[0][:2000]
        hf_ids = tokenizer.encode(text, add_special_tokens=True)
        ll_ids = runner.tokenize(text)
    finally:
        runner.close()
    same = sum(a == b for a, b in zip(hf_ids, ll_ids, strict=False))
    out["tokenizer_match"] = hf_ids == ll_ids
    out["tokenizer_agreement"] = round(same / max(len(hf_ids), len(ll_ids), 1), 4)
    return out


@dataclass(frozen=True)
class OnnxReference:
    """What the PyTorch model says, computed before the ONNX session opens, so the export can drop
    the PyTorch model first and never hold both in memory (issue 33)."""

    tokens: torch.Tensor  # [prefill + decode] evaluation token ids
    prefill: int
    logits: np.ndarray  # [prefill + decode, vocab] PyTorch's logits, one forward without cache
    greedy: list[int]  # PyTorch's greedy continuation of tokens[:GREEDY_PROMPT]


def onnx_reference(model, tokenizer) -> OnnxReference:
    """The PyTorch side of the ONNX parity check (fp32 `model`, the one the graph was traced from)."""
    from laco_deploy.data import evaluation_stream

    tokens = evaluation_stream(tokenizer, "builtin", PARITY_PREFILL + PARITY_DECODE)
    prefill = min(PARITY_PREFILL, max(1, tokens.numel() - PARITY_DECODE))
    with torch.no_grad():
        logits = model(tokens.view(1, -1), use_cache=False).logits[0].float().numpy()
    return OnnxReference(tokens, prefill, logits, torch_greedy(model, tokens[:GREEDY_PROMPT], GREEDY_NEW))


def onnx_compare(ref: OnnxReference, tokenizer, folder: Path) -> dict:
    """Logit parity (prefill + decode) and greedy-text match of the ONNX export in `folder` against
    the PyTorch reference; onnxruntime-genai too where the folder claims to run there."""
    from laco_deploy.runtimes.onnxrt import OrtDecoder

    decoder = OrtDecoder(folder, device="cpu")
    try:
        parity = logit_parity(ref.logits, decoder, ref.tokens, ref.prefill)
        greedy = greedy_match(ref.greedy, decoder, ref.tokens[:GREEDY_PROMPT])
    finally:
        del decoder
    trim_heap()  # the session's freed weights go back to the OS before onnxruntime-genai loads them (issue 33)
    out = {"parity": parity, "greedy": greedy, "provider": "CPUExecutionProvider"}
    if (folder / GENAI_FILE).is_file():  # the folder also claims to run in onnxruntime-genai: prove it
        from laco_deploy.data import load_texts
        from laco_deploy.runtimes.genai import genai_match

        text = load_texts("builtin", "eval")[0][:2000]
        out["genai"] = genai_match(ref.greedy, tokenizer, folder, ref.tokens[:GREEDY_PROMPT], text)
    return out


class TwoPhaseCheck(NamedTuple):
    """A parity check in two phases: `reference(model, tokenizer)` while the PyTorch model is
    loaded, `compare(reference, tokenizer, folder)` after the exporter has released it."""

    reference: Callable[[Any, Any], Any]
    compare: Callable[[Any, Any, Path], dict]


onnx_parity = TwoPhaseCheck(onnx_reference, onnx_compare)


def logit_parity(ref: np.ndarray, decoder, tokens: torch.Tensor, prefill: int) -> dict:
    """ref [n, vocab]: PyTorch's logits (no cache); decoder: laco_deploy.runtimes.onnxrt.OrtDecoder;
    tokens [n = prefill + decode] int64 -> max |diff| and top-1 agreement, prefill and decode apart."""
    ids = tokens.numpy().astype(np.int64)
    got = np.empty(ref.shape, dtype=np.float32)  # [n, vocab], filled in place: no concatenated copy
    got[:prefill], past = decoder.prefill(ids[:prefill])
    for pos in range(prefill, ids.shape[0]):
        got[pos], past = decoder.step(int(ids[pos]), pos, past)
    del past
    top1 = got.argmax(-1) == ref.argmax(-1)
    diff = np.abs(np.subtract(got, ref, out=got), out=got)  # |got - ref|, in got's memory
    steps = ids.shape[0] - prefill
    return {
        "prefill_tokens": int(prefill),
        "decode_steps": steps,
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


def greedy_match(ref: list[int], decoder, prompt: torch.Tensor) -> dict:
    """onnxruntime's greedy continuation of `prompt` [seq] against PyTorch's `ref` (torch_greedy),
    as many tokens."""
    new_tokens = len(ref)
    got = decoder.generate(prompt.numpy().astype(np.int64), new_tokens, eos_token_id=None)
    same = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), len(ref))
    return {"prompt_tokens": int(prompt.numel()), "new_tokens": new_tokens, "identical": ref == got,
            "matching_prefix": same}
