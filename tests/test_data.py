"""Data sources -> token samples: builtin split, files, determinism and bad inputs."""

from __future__ import annotations

import json

import pytest
import torch

from laco_deploy.data import builtin_path, calibration_samples, evaluation_windows, load_texts
from laco_deploy.errors import DataError


def test_builtin_calibration_and_evaluation_are_disjoint():
    calib, evals = load_texts("builtin", "calib"), load_texts("builtin", "eval")
    titles_c = {d.splitlines()[0] for d in calib}
    titles_e = {d.splitlines()[0] for d in evals}
    assert len(calib) > 50 and len(evals) > 15
    assert not titles_c & titles_e
    assert not set(calib) & set(evals)
    attribution = (builtin_path("calib").parent / "ATTRIBUTION.md").read_text()
    assert "CC BY-SA 3.0" in attribution and "Wikipedia" in attribution


def test_samples_are_deterministic_per_seed(bpe_tokenizer):
    a = calibration_samples(bpe_tokenizer, "builtin", 4, 32, seed=0)
    b = calibration_samples(bpe_tokenizer, "builtin", 4, 32, seed=0)
    c = calibration_samples(bpe_tokenizer, "builtin", 4, 32, seed=1)
    assert a.shape == (4, 32) and a.dtype == torch.long
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_evaluation_windows_are_contiguous(bpe_tokenizer):
    w = evaluation_windows(bpe_tokenizer, "builtin", 3, 16)
    assert w.shape == (3, 16)
    first_doc = load_texts("builtin", "eval")[0]
    head = bpe_tokenizer(first_doc, add_special_tokens=False)["input_ids"][:48]
    assert w.flatten().tolist() == head


def test_txt_and_jsonl_files(tmp_path, bpe_tokenizer):
    txt = tmp_path / "c.txt"
    txt.write_text("First document about letters.\n\nSecond document about numbers and more words.\n")
    jl = tmp_path / "c.jsonl"
    jl.write_text("\n".join(json.dumps({"text": t}) for t in ["alpha beta gamma delta", "epsilon zeta eta theta"]) + "\n")
    assert load_texts(str(txt)) == ["First document about letters.", "Second document about numbers and more words."]
    assert len(load_texts(str(jl))) == 2
    assert calibration_samples(bpe_tokenizer, str(jl), 2, 4, 0).shape == (2, 4)


@pytest.mark.parametrize(
    "content,match",
    [
        ("", "holds no text"),
        ("   \n\n  \n", "holds no text"),
    ],
)
def test_empty_file(tmp_path, content, match):
    f = tmp_path / "empty.txt"
    f.write_text(content)
    with pytest.raises(DataError, match=match):
        load_texts(str(f))


def test_bad_jsonl_and_missing_file(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2 is not valid JSON"):
        load_texts(str(f))
    f.write_text('{"body": "no text field"}\n')
    with pytest.raises(DataError, match="no string \"text\" field"):
        load_texts(str(f))
    with pytest.raises(DataError, match="not found"):
        load_texts(str(tmp_path / "missing.txt"))


def test_text_shorter_than_one_sample(tmp_path, bpe_tokenizer):
    f = tmp_path / "short.txt"
    f.write_text("just a few words")
    with pytest.raises(DataError, match="fewer than one sample of data.seqlen 256"):
        calibration_samples(bpe_tokenizer, str(f), 4, 256, 0)
    with pytest.raises(DataError, match="fewer than one window"):
        evaluation_windows(bpe_tokenizer, str(f), 4, 256)


def test_hf_dataset_offline(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(DataError, match="offline.*.txt or .jsonl"):
        load_texts("hf:wikitext:wikitext-2-raw-v1:test")
    with pytest.raises(DataError, match="expected hf:NAME"):
        load_texts("hf:")
