"""torchrun data parallelism: 2 gloo processes give what one process gives, and a failing rank ends the job.

Each 2-process run is a real `torchrun --standalone --nproc-per-node 2` of the CLI on a tiny model
(about 10-20 s on 2 busy cores, most of it imports); the 1-process reference runs in-process.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from laco_deploy import distributed
from laco_deploy.data import builtin_path

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 240  # a hung job fails the test instead of the suite
OUR_ERROR = re.compile(r"(^|: )(internal )?error: ")


@pytest.fixture(scope="module")
def calib(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("dist_calib") / "calib.txt"
    path.write_text(builtin_path("calib").read_text(encoding="utf-8")[:20_000], encoding="utf-8")
    return path


def torchrun(args: list, *, script: Path | None = None, nproc: int = 2) -> subprocess.CompletedProcess:
    """The CLI (or `script`) under torchrun on this checkout's code, one thread per rank."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", distributed.TIMEOUT_ENV: "60"}
    entry = [str(script)] if script is not None else ["-m", "laco_deploy.cli"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *entry,
           *[str(a) for a in args]]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env, cwd=ROOT)


def weights(model_dir: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def same_masks(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k] == 0, b[k] == 0) for k in a)


def test_shard_blocks_cover_every_sample_once(monkeypatch):
    monkeypatch.setattr(distributed, "world", lambda: 3)
    blocks = []
    for r in range(3):
        monkeypatch.setattr(distributed, "rank", lambda r=r: r)
        blocks.append(distributed.shard(10))
    assert [(b.start, b.stop) for b in blocks] == [(0, 4), (4, 7), (7, 10)]
    idx = torch.tensor([9, 0, 5, 4, 3])
    assert blocks[1].local(idx).tolist() == [1, 0] and blocks[1].owned(idx).tolist() == [False, False, True, True, False]
    with pytest.raises(Exception, match="2 calibration samples cannot be shared by 3 processes"):
        distributed.shard(2)


def test_single_process_is_the_whole_range():
    part = distributed.shard(7)
    idx = torch.tensor([3, 1])
    assert part.whole and (part.start, part.stop) == (0, 7) and part.local(idx) is idx
    assert distributed.all_reduce_floats([1.5]) == [1.5] and distributed.agree(True) and distributed.is_main()


@pytest.mark.parametrize("method", ["wanda", "sparsegpt"])
def test_prune_two_ranks_choose_the_same_masks(cli, tiny_llama_dir, calib, tmp_path, method):
    args = ["prune", "--model", tiny_llama_dir, "--method", method, "--calib", calib, "--samples", 6, "--seqlen", 32,
            "--device", "cpu"]
    code, _out, err = cli(*args, "--out", tmp_path / "one")
    assert code == 0, err
    run = torchrun(args + ["--out", tmp_path / "two"])
    assert run.returncode == 0, run.stderr[-3000:]
    one, two = weights(tmp_path / "one"), weights(tmp_path / "two")
    assert same_masks(one, two)
    assert max(float((one[k] - two[k]).abs().max()) for k in one) < 1e-4  # SparseGPT updates: float sums only
    assert run.stdout.count("written to") == 1  # rank 0 alone prints its summary
    assert not (tmp_path / "two.ckpt").exists()  # rank 0 removed the checkpoints after every rank finished


def _ppl(model_dir: Path, ids: torch.Tensor) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return float(torch.exp(model(ids, labels=ids).loss))


def test_compensate_two_ranks_train_like_one(cli, tiny_llama_dir, calib, tmp_path):
    code, _out, err = cli("prune", "--model", tiny_llama_dir, "--method", "wanda", "--calib", calib, "--samples", 4,
                          "--seqlen", 32, "--device", "cpu", "--out", tmp_path / "pruned")
    assert code == 0, err
    # batch 3 over 6 training samples split 3 + 3 between ranks: most batches straddle both shards
    args = ["compensate", "--dense", tiny_llama_dir, "--sparse", tmp_path / "pruned", "--calib", calib,
            "--samples", 8, "--seqlen", 32, "--epochs", 3, "--lr", 1e-3, "--batch-size", 3, "--val-fraction", 0.25,
            "--device", "cpu"]
    code, _out, err = cli(*args, "--out", tmp_path / "one")
    assert code == 0, err
    run = torchrun(args + ["--out", tmp_path / "two"])
    assert run.returncode == 0, run.stderr[-3000:]
    pruned, one, two = weights(tmp_path / "pruned"), weights(tmp_path / "one"), weights(tmp_path / "two")
    assert same_masks(one, two) and same_masks(pruned, two)
    moved = max(float((one[k] - pruned[k]).abs().max()) for k in one)
    apart = max(float((one[k] - two[k]).abs().max()) for k in one)
    assert moved > 1e-3 and apart < 0.05 * moved  # training moved the weights; the two runs agree
    ids = torch.randint(0, 200, (2, 48), generator=torch.Generator().manual_seed(0))
    ppl_one, ppl_two = _ppl(tmp_path / "one", ids), _ppl(tmp_path / "two", ids)
    assert abs(ppl_two / ppl_one - 1) < 0.01


def test_fidelity_two_ranks_report_the_same_numbers(cli, tiny_llama_dir, tiny_llama_untied_dir, calib, tmp_path):
    args = ["fidelity", "--dense", tiny_llama_dir, "--candidate", f"other={tiny_llama_untied_dir}", "--eval", calib,
            "--eval-samples", 5, "--seqlen", 32, "--device", "cpu"]
    code, _out, err = cli(*args, "--report", tmp_path / "one")
    assert code == 0, err
    run = torchrun(args + ["--report", tmp_path / "two"])
    assert run.returncode == 0, run.stderr[-3000:]
    one = json.loads((tmp_path / "one" / "fidelity.json").read_text())
    two = json.loads((tmp_path / "two" / "fidelity.json").read_text())
    m1, m2 = one["candidates"]["other"], two["candidates"]["other"]
    for key in ("ppl", "nll_mean", "top1", "p_top_delta"):
        assert m2["metrics"][key] == pytest.approx(m1["metrics"][key], rel=1e-9)
    assert m2["metrics"]["kl"] == pytest.approx(m1["metrics"]["kl"], rel=1e-9)
    assert m2["metrics"]["tokens"] == m1["metrics"]["tokens"] > 0
    assert [w["nll_mean"] for w in m2["per_window"]] == pytest.approx([w["nll_mean"] for w in m1["per_window"]], rel=1e-9)
    assert [c["rel_error"] for c in m2["per_layer"]] == pytest.approx([c["rel_error"] for c in m1["per_layer"]], rel=1e-9)
    assert two["dense"]["ppl"] == pytest.approx(one["dense"]["ppl"], rel=1e-9)


def _our_errors(run: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (run.stdout + run.stderr).splitlines() if OUR_ERROR.search(line)]


def test_a_rank_with_bad_input_ends_the_job_with_one_message(tiny_llama_dir, calib, tmp_path):
    """Rank 1 is given a model path that does not exist; rank 0 has a good one and would wait for
    rank 1 in its first all-reduce. The job must end on both ranks with a single error line."""
    script = tmp_path / "rank1_bad.py"
    script.write_text(
        "import os, sys\n"
        "from laco_deploy.cli import main\n"
        "args = sys.argv[1:]\n"
        "if os.environ['RANK'] == '1':\n"
        "    args[args.index('--model') + 1] = '/no/such/model'\n"
        "main(args)\n")
    t0 = time.perf_counter()
    run = torchrun(["prune", "--model", tiny_llama_dir, "--method", "wanda", "--calib", calib, "--samples", 4,
                    "--seqlen", 32, "--device", "cpu", "--out", tmp_path / "out"], script=script)
    assert run.returncode != 0
    assert time.perf_counter() - t0 < 120
    errors = _our_errors(run)
    assert len(errors) == 1 and "rank 1/2: error:" in errors[0] and "/no/such/model" in errors[0], run.stderr[-3000:]
    assert not (tmp_path / "out").exists()


def test_bad_input_on_every_rank_prints_one_line(tiny_llama_dir, calib, tmp_path):
    run = torchrun(["prune", "--model", tiny_llama_dir, "--calib", calib, "--samples", 4, "--seqlen", 32,
                    "--sparsity", 1.5, "--device", "cpu", "--out", tmp_path / "out"])
    assert run.returncode != 0
    errors = _our_errors(run)
    assert len(errors) == 1 and "--sparsity 1.5 must be in [0, 1)" in errors[0], run.stderr[-3000:]
