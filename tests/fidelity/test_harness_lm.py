"""ContinuationLM: the harness's scores unchanged, with the LM head run only at the continuations'
positions when one sequence goes per call (the whole input otherwise)."""

from __future__ import annotations

import random

import pytest
import torch
from lm_eval.models.huggingface import HFLM

import tiny
from laco_deploy.fidelity.harness_lm import MIN_ROWS, ContinuationLM


def _requests(tok, n: int = 12, seed: int = 0):
    """(context, continuation) token requests as the harness passes them: contexts of 3-60 tokens,
    continuations of 1-6 tokens (one-token ones share contexts, as multiple-choice tasks do)."""
    rng = random.Random(seed)
    ids = tok("The castle stood on the hill above the river, and the town grew around it. " * 6)["input_ids"]
    out = []
    for i in range(n):
        ctx = ids[: rng.randint(3, 60)]
        cont = ids[len(ctx): len(ctx) + (1 if i % 3 == 0 else rng.randint(1, 6))]
        out.append(((f"c{i}", f"x{i}"), ctx, cont))
    out.append((("c-shared", "y"), out[0][1], [ids[70]]))  # a second one-token choice of request 0's context
    return out


def _head_rows(model, fn):
    """fn() and the numbers of positions the LM head was run on, one per forward."""
    seen = []
    hook = model.lm_head.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[1]))
    try:
        return fn(), seen
    finally:
        hook.remove()


@pytest.mark.parametrize("config", [tiny.llama_config, tiny.gemma3_config])
def test_scores_equal_the_harness_and_the_head_sees_the_continuations_only(config, bpe_tokenizer):
    model = tiny.build_model(config(), seed=3)
    reqs = _requests(bpe_tokenizer)
    expected = HFLM(pretrained=model, tokenizer=bpe_tokenizer, batch_size=1)._loglikelihood_tokens(reqs)
    lm = ContinuationLM(pretrained=model, tokenizer=bpe_tokenizer, batch_size=1)
    got, rows = _head_rows(model, lambda: lm._loglikelihood_tokens(reqs))
    assert got == expected  # log-likelihoods to the bit, greedy flags equal
    longest = max(len(cont) for _, _, cont in reqs)
    assert rows and max(rows) == max(MIN_ROWS, longest)  # never the whole request (up to 65 positions)
    assert lm._tail is None  # cleared after scoring


def test_batches_of_several_sequences_run_whole(bpe_tokenizer):
    """Calls of several right-padded sequences: continuations end at different positions, so every position is made."""
    model = tiny.build_model(tiny.llama_config(), seed=4)
    reqs = _requests(bpe_tokenizer, seed=1)
    expected = HFLM(pretrained=model, tokenizer=bpe_tokenizer, batch_size=4)._loglikelihood_tokens(reqs)
    lm = ContinuationLM(pretrained=model, tokenizer=bpe_tokenizer, batch_size=4)
    got, rows = _head_rows(model, lambda: lm._loglikelihood_tokens(reqs))
    assert got == expected
    assert max(rows) > max(len(cont) for _, _, cont in reqs)


def test_rolling_loglikelihood_equals_the_harness(bpe_tokenizer):
    """Perplexity tasks score whole windows as continuations: the tail is the window, results unchanged."""
    from lm_eval.api.instance import Instance

    model = tiny.build_model(tiny.llama_config(), seed=5)
    text = "The castle stood on the hill above the river, and the town grew around it. " * 12
    inst = [Instance("loglikelihood_rolling", {}, (text,), 0)]
    expected = HFLM(pretrained=model, tokenizer=bpe_tokenizer, batch_size=1, max_length=64).loglikelihood_rolling(inst)
    got = ContinuationLM(pretrained=model, tokenizer=bpe_tokenizer, batch_size=1, max_length=64).loglikelihood_rolling(inst)
    assert got == expected
    assert torch.isfinite(torch.tensor(got)).all()
