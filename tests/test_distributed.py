"""torchrun data parallelism: 2 gloo processes give what one process gives, and a failing rank ends the job.

Each 2-process run is a real `torchrun --standalone --nproc-per-node 2` of the CLI (or of a job in
tests/dist_jobs.py) on a tiny model (about 10-20 s on 2 busy cores, most of it imports); the
1-process reference runs in-process.
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

import dist_jobs
from laco_deploy import distributed
from laco_deploy.data import builtin_path

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 240  # a hung job fails the test instead of the suite
OUR_ERROR = re.compile(r"(^|: )(internal )?error: ")
JOBS = Path(dist_jobs.__file__)


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


def cli_ok(args: list) -> None:
    """The CLI in this process (for module-scoped fixtures, which cannot use the `cli` fixture)."""
    from laco_deploy.cli import main

    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in args])
    assert exc.value.code in (0, None)


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


@pytest.fixture(scope="module")
def pruned(tiny_llama_dir, calib, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist_pruned") / "pruned"
    cli_ok(["prune", "--model", tiny_llama_dir, "--method", "wanda", "--calib", calib, "--samples", 4, "--seqlen", 32,
            "--device", "cpu", "--out", out])
    return out


def _laco_args(tiny_llama_dir: Path, pruned: Path, calib: Path) -> list:
    # batch 3 over 6 training samples split 3 + 3 between ranks: most batches straddle both shards;
    # fp32, where ranks equal one process up to float-sum order (dist_jobs.BASE says why)
    return ["compensate", "--dense", tiny_llama_dir, "--sparse", pruned, "--calib", calib, "--samples", 8,
            "--seqlen", 32, "--epochs", 3, "--lr", 1e-3, "--batch-size", 3, "--val-fraction", 0.25, "--device", "cpu",
            "--precision", "fp32", "--final-kl-epochs", 0]  # the walk's property; dist_jobs "final_kl" has the pass


@pytest.fixture(scope="module")
def laco_two(tiny_llama_dir, pruned, calib, tmp_path_factory) -> Path:
    """An uninterrupted 2-process LaCo run of the CLI (shared by the equivalence and resume tests)."""
    out = tmp_path_factory.mktemp("dist_laco") / "two"
    run = torchrun(_laco_args(tiny_llama_dir, pruned, calib) + ["--out", out])
    assert run.returncode == 0, run.stderr[-3000:]
    return out


def test_compensate_two_ranks_train_like_one(cli, tiny_llama_dir, pruned, calib, laco_two, tmp_path):
    code, _out, err = cli(*_laco_args(tiny_llama_dir, pruned, calib), "--out", tmp_path / "one")
    assert code == 0, err
    before, one, two = weights(pruned), weights(tmp_path / "one"), weights(laco_two)
    assert same_masks(one, two) and same_masks(before, two)
    moved = max(float((one[k] - before[k]).abs().max()) for k in one)
    apart = max(float((one[k] - two[k]).abs().max()) for k in one)
    assert moved > 1e-3 and apart < 0.05 * moved  # training moved the weights; the two runs agree
    ids = torch.randint(0, 200, (2, 48), generator=torch.Generator().manual_seed(0))
    ppl_one, ppl_two = _ppl(tmp_path / "one", ids), _ppl(laco_two, ids)
    assert abs(ppl_two / ppl_one - 1) < 0.01


def test_compensate_resume_under_torchrun_equals_uninterrupted(tiny_llama_dir, pruned, calib, laco_two, tmp_path):
    """A 2-process LaCo job that dies after layer 0's checkpoint resumes with 2 processes: layer 0 is
    restored on both ranks (rank 0's decision), only layer 1 is trained, and the weights equal those
    of an uninterrupted 2-process run bit for bit (same shards, same gloo sums, checkpoints are exact)."""
    args = _laco_args(tiny_llama_dir, pruned, calib) + ["--out", tmp_path / "resumed"]
    ckpt = tmp_path / "resumed.ckpt"
    died = torchrun(["fail-at-layer-1", *args], script=JOBS)
    assert died.returncode != 0 and "--resume" in died.stderr, died.stderr[-3000:]
    assert (ckpt / "layer_000.safetensors").is_file() and not (ckpt / "layer_001.safetensors").exists()
    assert not (tmp_path / "resumed").exists()
    done = torchrun(["count-training", *args, "--resume"], script=JOBS)
    assert done.returncode == 0, done.stderr[-3000:]
    trained = re.findall(re.escape(dist_jobs.MARK) + r" \(seed (\d+)\) on rank (\d)", done.stderr)
    assert sorted(trained) == [("1", "0"), ("1", "1")], done.stderr[-3000:]  # layer 1 (seed 0 + 1) on both ranks
    full, resumed = weights(laco_two), weights(tmp_path / "resumed")
    assert full.keys() == resumed.keys() and all(torch.equal(full[k], resumed[k]) for k in full)
    assert not ckpt.exists()


def test_build_resume_under_torchrun_equals_uninterrupted(tiny_llama_dir, calib, tmp_path):
    """build's prune and compensate stages in a 2-process job, stopped as LaCo reaches layer 1 and
    resumed: prune is reused (rank 0's decision), only layer 1 is trained on each rank, and the
    recovered weights equal those of an uninterrupted 2-process build bit for bit."""
    run = torchrun(["build-resume", tiny_llama_dir, calib, tmp_path], script=JOBS)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["stages_after_kill"] == ["prune"] and result["prune_reused"]
    assert result["trained"] == [[1], [1]]
    ref, got = weights(Path(result["reference"])), weights(Path(result["recovered"]))
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)


@pytest.fixture(scope="module")
def option_runs(tiny_llama_dir, pruned, calib, tmp_path_factory) -> tuple[Path, dict, dict]:
    """Every option set of dist_jobs.OPTIONS, in this process and in one 2-process job."""
    root = tmp_path_factory.mktemp("dist_options")
    one = dist_jobs.compensate_options(tiny_llama_dir, pruned, calib, root / "one", list(dist_jobs.OPTIONS))
    run = torchrun(["options", tiny_llama_dir, pruned, calib, root / "two", ",".join(dist_jobs.OPTIONS)], script=JOBS)
    assert run.returncode == 0, run.stderr[-3000:]
    return root, one, json.loads((root / "two" / "records.json").read_text())


@pytest.mark.parametrize("name", list(dist_jobs.OPTIONS))
def test_laco_options_two_ranks_like_one(option_runs, pruned, name):
    """Each LaCo loss and option gives the 1-process result with 2 processes: the losses before
    training agree to fp32 rounding (cos_mse's batch scale was per rank: 2.6e-3 apart), and the
    trained weights differ by float-order noise, under 2% of how far training moved them."""
    root, one, two = option_runs
    before, w1, w2 = weights(pruned), weights(root / "one" / name), weights(root / "two" / name)
    assert same_masks(before, w1) and same_masks(w1, w2)
    moved = max(float((w1[k] - before[k]).abs().max()) for k in w1)
    apart = max(float((w1[k] - w2[k]).abs().max()) for k in w1)
    assert moved > 1e-4 and apart < 0.02 * moved, (moved, apart)
    for r1, r2 in zip(one[name], two[name], strict=True):
        for key in ("loss_before", "loss_after", "nmse_after"):
            assert r2[key] == pytest.approx(r1[key], rel=1e-5), key
        assert r2["epochs_run"] == r1["epochs_run"] and r2["best_epoch"] == r1["best_epoch"]
    if name == "lsq":  # the refit's summed statistics are used, not thrown away
        assert any(r["refit_kept"] for r in one[name]) and [r["refit_kept"] for r in one[name]] == \
            [r["refit_kept"] for r in two[name]]


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
