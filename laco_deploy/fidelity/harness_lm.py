"""lm-evaluation-harness's HFLM, with the LM head run only where the harness reads the logits.

The harness scores a (context, continuation) request from the log-softmax of the logits at the
continuation's positions only, but asks the model for every position: [batch, tokens, vocab] logits
and their log-softmax copy, 2 x tokens MiB per sequence at Gemma 3's 262k vocabulary (~200 MiB for a
100-token request), and the head's matrix multiply over every position. With one sequence per call
(no padding), `ContinuationLM` asks the model for the last `tail` positions only (transformers'
`logits_to_keep`), `tail` being the longest continuation of the requests being scored. The harness
takes logits shorter than its input as it takes a prompt-tuned model's ("virtual tokens": the
context length it slices by is the input length plus the logits' length minus the input's), so it
reads the same continuation positions, each position's logits made by the same head from the same
hidden state. The head runs on at least MIN_ROWS positions: a matrix multiply of 1-3 rows (up to 8 on
2 threads) takes other kernels than a whole request's and rounds differently (measured on this
project's CPUs: from 12 rows on every row came out bit-identical to the whole multiply's, on 1 and 2
threads), so the scores equal the harness's to the bit where measured (32 MiB more at most, at 262k).
Calls of several sequences (right-padded: their continuations end at different positions) and models
without `logits_to_keep` go through the harness unchanged.
"""

from __future__ import annotations

import inspect

import torch
from lm_eval.models.huggingface import HFLM

MIN_ROWS = 16  # the fewest positions the head runs on (see above)


class ContinuationLM(HFLM):
    """HFLM whose single-sequence forwards make logits for the longest continuation's positions only."""

    _tail: int | None = None  # the longest continuation, while `_loglikelihood_tokens` runs

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        # requests: ((context, continuation), context token ids, continuation token ids); the tail
        # applies to the calls that carry one sequence (_model_call)
        if self.backend == "causal" and requests and _keeps_logits(self.model):
            self._tail = max(MIN_ROWS, *(len(cont) for _, _, cont in requests))
        try:
            return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm, override_bs=override_bs)
        finally:
            self._tail = None

    def _model_call(self, inps: torch.Tensor, attn_mask: torch.Tensor | None = None,
                    labels: torch.Tensor | None = None) -> torch.Tensor:
        """inps: [1, tokens] -> logits [1, tail, vocab] of the last positions (all where tokens <= tail)."""
        tail = self._tail
        if (tail is None or attn_mask is not None or labels is not None or inps.shape[0] != 1
                or tail >= inps.shape[1] or self.mixed_precision_dtype is not None):
            return super()._model_call(inps, attn_mask=attn_mask, labels=labels)
        with torch.no_grad():
            return self.model(inps, logits_to_keep=tail).logits


def _keeps_logits(model) -> bool:
    """Whether the model's forward takes transformers' `logits_to_keep` (every causal LM family we load does)."""
    return "logits_to_keep" in inspect.signature(model.forward).parameters
