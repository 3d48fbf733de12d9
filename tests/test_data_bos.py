"""Samples start as the model's tokenizer starts a sequence: BOS where it adds one, nothing where it does not."""

from __future__ import annotations

import pytest
import torch

from laco_deploy.data import (
    SAMPLE_FORMAT,
    calibration_samples,
    evaluation_stream,
    evaluation_windows,
    load_texts,
    sample_format,
    sequence_affixes,
)

from tests import tiny


@pytest.fixture(scope="module", params=["sentencepiece", "template"])
def sp_tokenizer(request, tmp_path_factory):
    """Tokenizers whose `tokenizer(text)` prepends BOS: Llama-2 style SentencePiece (add_bos_token) and
    a fast tokenizer whose post-processor adds it (Llama 3, Gemma)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if request.param == "sentencepiece":
        work = tmp_path_factory.mktemp("sp_bos")
        tiny.train_sentencepiece_tokenizer(work, vocab_size=400)
        return AutoTokenizer.from_pretrained(work / "tok", add_bos_token=True)
    from tokenizers.processors import TemplateProcessing

    backend = tiny.train_bpe_tokenizer().backend_tokenizer
    bos = backend.token_to_id("<|im_start|>")
    backend.post_processor = TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", bos)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|endoftext|>")


def test_affixes_are_what_the_tokenizer_adds(sp_tokenizer, bpe_tokenizer):
    assert sequence_affixes(sp_tokenizer) == ([sp_tokenizer.bos_token_id], [])
    assert sequence_affixes(bpe_tokenizer) == ([], [])  # GPT-2 style: no BOS even though one is named
    assert sample_format(sp_tokenizer) == {"version": SAMPLE_FORMAT, "prefix": [sp_tokenizer.bos_token_id],
                                           "separator": [sp_tokenizer.eos_token_id]}


def test_bos_tokenizer_every_sample_and_window_starts_with_bos(sp_tokenizer):
    bos = sp_tokenizer.bos_token_id
    calib = calibration_samples(sp_tokenizer, "builtin", 16, 64, seed=0)
    windows = evaluation_windows(sp_tokenizer, "builtin", 8, 64)
    for rows in (calib, windows):
        assert rows.shape[1] == 64
        assert (rows[:, 0] == bos).all()
        assert not (rows[:, 1] == bos).any()  # never BOS twice: a window at a document start keeps its own
    first_doc = load_texts("builtin", "eval")[0]
    assert windows[0].tolist() == sp_tokenizer(first_doc)["input_ids"][:64]  # exactly what the model sees alone


def test_bos_windows_cover_the_stream_without_gaps(sp_tokenizer):
    """Windows cut inside a document carry BOS then the next tokens: dropping the added BOS gives the
    stream back, so nothing is skipped or scored twice; documents inside a window are EOS, BOS, text."""
    bos, eos = sp_tokenizer.bos_token_id, sp_tokenizer.eos_token_id
    windows = evaluation_windows(sp_tokenizer, "builtin", 12, 48)
    stream = evaluation_stream(sp_tokenizer, "builtin")
    rebuilt = windows[0].tolist()
    for w in windows[1:].tolist():
        rebuilt += w if stream[len(rebuilt)].item() == bos else w[1:]
    assert rebuilt == stream[: len(rebuilt)].tolist()
    flat = stream.tolist()
    after_eos = [flat[i + 1] for i, t in enumerate(flat[:-1]) if t == eos]
    assert after_eos and set(after_eos) == {bos}


def test_no_bos_tokenizer_windows_are_the_plain_stream(bpe_tokenizer):
    docs = load_texts("builtin", "eval")
    plain: list[int] = []
    for d in docs[:3]:
        plain += bpe_tokenizer(d, add_special_tokens=False)["input_ids"] + [bpe_tokenizer.eos_token_id]
    w = evaluation_windows(bpe_tokenizer, "builtin", 4, 32)
    assert w.flatten().tolist() == plain[: w.numel()]


def test_samples_differ_from_bare_stream_only_where_bos_is_added(sp_tokenizer):
    """The recorded token hash moves with the change for a BOS tokenizer (the first token is BOS, not text)."""
    from laco_deploy.fidelity.provenance import tokens_hash

    windows = evaluation_windows(sp_tokenizer, "builtin", 4, 32)
    bare: list[int] = []
    for d in load_texts("builtin", "eval")[:3]:
        bare += sp_tokenizer(d, add_special_tokens=False)["input_ids"] + [sp_tokenizer.eos_token_id]
    old = torch.tensor(bare[: windows.numel()]).view(4, 32)
    assert tokens_hash(windows) != tokens_hash(old)


def test_reuse_keys_name_the_sample_format():
    """A cached prune/compensate/fidelity stage made from the old windows is not reused."""
    from laco_deploy.config import DataConfig
    from laco_deploy.pipeline_stages import _calib, _eval

    assert _calib(DataConfig())["sample_format"] == SAMPLE_FORMAT
    assert _eval(DataConfig())["sample_format"] == SAMPLE_FORMAT
