"""What a report may claim: a candidate worse than the pruned model is called so on its row, and no
gap-closed share is shown when PyTorch and the runtime disagree on the dense model."""

from __future__ import annotations

import pytest

from laco_deploy.fidelity.report import markdown, verdict_lines
from laco_deploy.fidelity.verdicts import runtime_agreement, worse_domains, worse_than_pruned
from laco_deploy.summary import summarize, summary_lines


def _cand(kl: float, top1: float, ppl: dict[str, float]) -> dict:
    return {"path": "x", "runtime": "pytorch", "sha256": None,
            "metrics": {"kl": {"mean": kl, "median": kl, "p99": kl, "max": kl}, "top1": top1, "p_top_delta": 0.0,
                        "ppl": ppl["wikipedia"], "ppl_ratio": 1.0},
            "domains": {d: {"ppl": p, "kl_mean": kl, "top1": top1} for d, p in ppl.items()}}


def _fid(laco_kl: float, laco_top1: float, agreement: dict | None = None) -> dict:
    """A fidelity.json like issue 31's Gemma 3 build: LaCo lowers torch perplexity on both domains."""
    dense = {"wikipedia": 20.0, "fiction": 30.0}
    return {"dense": {"model": "m", "path": "m", "sha256": None, "ppl": 20.0,
                      "domains": {d: {"ppl": p, "tokens_scored": 10} for d, p in dense.items()}},
            "candidates": {"pruned": _cand(1.339, 0.4672, {"wikipedia": 50.0, "fiction": 70.0}),
                           "laco": _cand(laco_kl, laco_top1, {"wikipedia": 40.0, "fiction": 60.0})},
            "gates": [], "passed": True, "notes": [], "runtime_agreement": agreement,
            "settings": {"eval": "domains", "windows": 2, "seqlen": 8, "tokens_sha256": "0" * 64, "device": "cpu",
                         "domains": [{"label": "wikipedia", "in_domain": True}, {"label": "fiction", "in_domain": False}]}}


def _agreement(runtime_ppl: float) -> dict:
    return runtime_agreement("llama.cpp", "dense.gguf", 81.3, runtime_ppl, 0.10, kl_mean=0.5, top1=0.6,
                             domains={"wikipedia": (81.3, runtime_ppl)}, windows=64)


def _summary(fid: dict) -> tuple[dict, str]:
    s = summarize({"stages": {"fidelity": {"result": fid}}})
    return s, "\n".join(summary_lines(s, "out"))


def test_worse_kl_or_top1_is_named_on_the_row_and_gets_no_gap():
    fid = _fid(1.663, 0.3935)
    assert worse_than_pruned(fid["candidates"]) == {"laco": "WORSE than pruned: KL 1.34 -> 1.66, top-1 46.7% -> 39.4%"}
    s, text = _summary(fid)
    row = next(line for line in text.splitlines() if line.startswith("laco "))
    assert "WORSE than pruned: KL 1.34 -> 1.66" in row
    assert s["gap_closed_by_domain"] == {}  # lower torch ppl, yet no "gap closed" for a model KL calls worse
    assert "no gap-closed share for laco" in text
    assert "laco (WORSE than pruned)" in markdown(fid)


def test_only_top1_worse_is_flagged_too():
    assert worse_than_pruned(_fid(1.0, 0.40)["candidates"]) == {"laco": "WORSE than pruned: top-1 46.7% -> 40.0%"}


def test_better_model_gets_its_gap_and_no_flag():
    s, text = _summary(_fid(0.9, 0.55))
    assert s["worse_than_pruned"] == {} and "WORSE" not in text
    assert s["gap_closed_by_domain"]["laco"] == pytest.approx({"wikipedia": 1 / 3, "fiction": 0.25})


def test_a_domain_made_worse_is_named_and_gets_no_gap():
    """Better on the whole, worse on one kind of text (Gemma 3's dialogue at 256 samples): the whole-model
    verdict passes it, the domain's row says WORSE instead of a share of the gap."""
    fid = _fid(0.9, 0.55)
    fid["candidates"]["laco"]["domains"]["fiction"]["kl_mean"] = 1.5  # pruned: 1.339
    assert worse_than_pruned(fid["candidates"]) == {}
    assert worse_domains(fid["candidates"]) == {"laco": {"fiction": "KL 1.34 -> 1.5"}}
    s, text = _summary(fid)
    assert s["gap_closed_by_domain"]["laco"] == pytest.approx({"wikipedia": 1 / 3})
    assert "laco is WORSE than pruned on fiction: KL 1.34 -> 1.5" in text
    row = next(line for line in text.splitlines() if line.startswith("laco ") and "(WORSE)" in line)
    assert "(33%)" in row


@pytest.mark.parametrize("runtime_ppl,agree", [(18.98, False), (81.3 * 1.09, True), (81.3 * 0.89, False)])
def test_runtime_disagreement_withholds_every_gap(runtime_ppl, agree):
    rec = _agreement(runtime_ppl)
    assert rec["agree"] is agree and rec["ratio"] == pytest.approx(runtime_ppl / 81.3)
    s, text = _summary(_fid(0.9, 0.55, rec))
    if agree:
        assert s["gap_closed_by_domain"]["laco"] and not text.count("WARNING")
        assert "PyTorch and llama.cpp agree" in text
    else:
        assert s["gap_closed_by_domain"] == {} and s["gap_withheld"]
        assert "WARNING: PyTorch and llama.cpp DISAGREE" in text and "no gap-closed shares" in text
        assert ("PyTorch and llama.cpp DISAGREE" in verdict_lines(_fid(0.9, 0.55, rec))[0][0])
        assert "**PyTorch and llama.cpp DISAGREE" in markdown(_fid(0.9, 0.55, rec))


def test_non_finite_perplexity_never_agrees():
    assert not runtime_agreement("llama.cpp", "x", float("nan"), 10.0, 0.1, kl_mean=0, top1=1, domains={},
                                 windows=1)["agree"]
    assert not runtime_agreement("llama.cpp", "x", 10.0, float("inf"), 0.1, kl_mean=0, top1=1, domains={},
                                 windows=1)["agree"]
