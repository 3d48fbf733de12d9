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


def test_builtin_mixed_is_wikipedia_then_python_and_never_evaluation():
    from laco_deploy.data import builtin_files, shipped_domains

    mixed, wiki = load_texts("builtin:mixed", "calib"), load_texts("builtin", "calib")
    code_half = mixed[len(wiki):]
    assert mixed[: len(wiki)] == wiki and len(code_half) == 36
    # about half of the characters each (what benchmarks/RESULTS.md measured)
    assert 0.4 < sum(map(len, code_half)) / sum(map(len, mixed)) < 0.6
    # no calibration document is evaluation text, and the stdlib modules differ from the code domain's
    evaluation = set(load_texts("builtin", "eval"))
    for name in shipped_domains():
        evaluation |= set(load_texts(f"builtin:{name}", "eval"))
    assert not set(mixed) & evaluation
    shipped = builtin_files("builtin:mixed", "calib")[-1]
    calib_sources = {json.loads(line)["source"] for line in shipped.read_text(encoding="utf-8").splitlines()}
    code_domain = builtin_files("builtin:code", "eval")[0]
    eval_sources = {json.loads(line)["source"] for line in code_domain.read_text(encoding="utf-8").splitlines()}
    assert len(calib_sources) == 36 and len(eval_sources) == 18 and not calib_sources & eval_sources
    with pytest.raises(DataError, match="builtin:mixed is a calibration-only text"):
        load_texts("builtin:mixed", "eval")
    attribution = (shipped.parent / "ATTRIBUTION.md").read_text()
    assert "calibration_code.jsonl" in attribution and "LICENSE-PSF.txt" in attribution


def test_builtin_mixed_samples_draw_from_both_halves(bpe_tokenizer):
    ids = calibration_samples(bpe_tokenizer, "builtin:mixed", 64, 32, seed=0)
    text = [bpe_tokenizer.decode(row) for row in ids]
    # Python source shows keywords/indentation the Wikipedia articles lack
    code_like = sum(("def " in t or "self." in t or "    " in t) for t in text)
    assert ids.shape == (64, 32) and 10 < code_like < 54


def test_builtin_mixed_reuse_key_hashes_both_files():
    from laco_deploy.data import fingerprint

    mixed, wiki = fingerprint("builtin:mixed", "calib"), fingerprint("builtin", "calib")
    assert mixed.startswith(wiki + ":") and len(mixed) == 2 * len(wiki) + 1


def test_in_domain_is_the_genres_calibration_covers():
    """Reports call a text in-domain when calibration covers its genre: builtin:mixed holds Wikipedia
    and Python source, so the code text counts as in-domain there and fiction/techdoc stay out."""
    from laco_deploy.data import eval_specs, in_domain

    specs = eval_specs("domains")
    assert [s for s in specs if in_domain(s, "builtin")] == ["builtin"]
    assert [s for s in specs if in_domain(s, "builtin:mixed")] == ["builtin", "builtin:code"]
    assert [s for s in specs if in_domain(s, "my_notes.txt")] == []
    assert in_domain("my_notes.txt", "my_notes.txt")


def test_dialogue_is_an_attributed_evaluation_only_chat_text():
    """The conversational out-of-domain text (issue 29): part of `domains`, never calibration, two-party
    turns, no conversation twice, its BSD licence kept beside it and named in the attribution."""
    from laco_deploy.data import builtin_files, eval_specs

    assert "builtin:dialogue" in eval_specs("domains")
    docs = load_texts("builtin:dialogue", "eval")
    assert len(docs) == 20 and 80_000 < sum(map(len, docs)) < 90_000
    conversations = [c for d in docs for c in d.split("\n\n")]
    assert all(c.startswith("User: ") and "\nAssistant: " in c for c in conversations)
    assert len(set(conversations)) == len(conversations)
    with pytest.raises(DataError, match="evaluation-only"):
        load_texts("builtin:dialogue", "calib")
    folder = builtin_files("builtin:dialogue", "eval")[0].parent
    assert "Copyright (c) 2017, Gunther Cox" in (folder / "LICENSE-chatterbot-corpus.txt").read_text()
    attribution = (folder / "ATTRIBUTION.md").read_text()
    assert "dialogue.jsonl" in attribution and "LICENSE-chatterbot-corpus.txt" in attribution and "chatterbot-corpus" in attribution
