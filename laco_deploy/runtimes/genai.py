"""onnxruntime-genai on an ONNX export folder: its greedy tokens and its tokenizer against ours.

Run by the ONNX export's parity check (laco_deploy.runtimes.parity.onnx_parity) when the folder holds
a genai_config.json (exporters.onnx_genai). onnxruntime-genai is optional: without it the check
says so instead of failing the export.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)


def genai_match(ref: list[int], tokenizer, folder: Path, prompt: torch.Tensor, text: str) -> dict:
    """Greedy continuation of `prompt` [seq] in onnxruntime-genai against PyTorch's `ref` (the fp32
    model's greedy tokens, parity.torch_greedy: as many are generated), and genai's tokenizer
    against `tokenizer` on `text`."""
    new_tokens = len(ref)
    try:
        import onnxruntime_genai as og
    except ImportError:
        return {"checked": False, "why": "onnxruntime-genai is not installed (pip install onnxruntime-genai)"}
    try:
        og_model = og.Model(str(folder))
    except Exception as e:  # e.g. a model type this genai version does not know: report, do not fail the export
        return {"checked": False, "why": f"onnxruntime-genai {og.__version__} cannot open the folder: {e}"}
    try:
        params = og.GeneratorParams(og_model)
        length = prompt.numel() + new_tokens
        params.set_search_options(max_length=length, min_length=length, do_sample=False)  # min: EOS cannot stop it early
        generator = og.Generator(og_model, params)
        generator.append_tokens(prompt.numpy().astype(np.int32))
        got: list[int] = []
        while not generator.is_done() and len(got) < new_tokens:
            generator.generate_next_token()
            got.append(int(generator.get_next_tokens()[0]))
        del generator
        ours = tokenizer(text)["input_ids"]
        theirs = [int(t) for t in og.Tokenizer(og_model).encode(text)]
    finally:
        del og_model
    same = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
    return {"checked": True, "version": og.__version__, "prompt_tokens": int(prompt.numel()), "new_tokens": new_tokens,
            "greedy_identical": ref == got, "matching_prefix": same, "tokenizer_match": ours == theirs}
