"""Output paths are never destructive (issue 28): a command writes a new file or folder, or replaces an
earlier laco-deploy output only with --force; an existing file, a folder holding anything else, or the
current folder is refused before any work, in one line naming the path and the choices.

Sentinel files lie next to and inside every --out; each case checks them after the command, failed or
not. Refusals replace the slow step with a function that fails the test if it is reached, so the
order is checked, not only the message.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from laco_deploy.fsutil import MARKER, write_marker

PRECIOUS = "precious, not laco-deploy's\n"
FAST = ["--samples", "4", "--seqlen", "16", "--device", "cpu"]


def _never(what: str):
    def slow(*args, **kwargs):
        raise AssertionError(f"{what} ran although --out was refused")
    return slow


@pytest.fixture()
def no_work(monkeypatch):
    """Every command's slow step fails the test when reached."""
    for stage, what in (("prune", "pruning"), ("compensate", "compensation")):  # the boundary's entry and the trusted one
        for entry in ("run", "run_checked"):
            monkeypatch.setattr(importlib.import_module(f"laco_deploy.{stage}"), entry, _never(what))
    monkeypatch.setattr(importlib.import_module("laco_deploy.pipeline"), "build", _never("the build"))
    monkeypatch.setattr(importlib.import_module("laco_deploy.targets").Target, "export", _never("the export"))
    monkeypatch.setattr(importlib.import_module("laco_deploy.imatrix"), "compute", _never("the importance matrix"))


def _args(command: str, tiny: Path, out: Path) -> list:
    return {
        "prune": ["prune", "--model", tiny, "--out", out, *FAST],
        "compensate": ["compensate", "--dense", tiny, "--sparse", tiny, "--out", out, "--method", "none"],
        "export-gguf": ["export", "--model", tiny, "--target", "gguf", "--quant", "f32", "--out", out],
        "export-onnx": ["export", "--model", tiny, "--target", "onnx", "--out", out],
        "build": ["build", "--model", tiny, "--out", out, "--samples", "4", "--seqlen", "16", "--calib", "builtin"],
        "imatrix": ["imatrix", "--model", tiny, "--out", out, *FAST],
    }[command]


class Sentinels:
    """User files next to `out` (the old backup name `.out.old` among them) and, for a folder, inside it."""

    def __init__(self, root: Path, out: Path, inside: bool):
        self.files = [root / "neighbour.txt", root / f".{out.name}.old", root / "sub" / "deep.txt"]
        if inside:
            self.files += [out / "keep.txt", out / "nested" / "notes.md"]
        for f in self.files:
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(PRECIOUS)

    def intact(self) -> list[str]:
        return [str(f) for f in self.files if not f.is_file() or f.read_text() != PRECIOUS]


def _earlier_output(out: Path, command: str) -> None:
    """What an earlier run of `command` left at `out` (marker and all)."""
    if command in GGUF_FILES:
        import gguf

        writer = gguf.GGUFWriter(str(out), "llama")
        writer.add_string("laco_deploy.exporter", "laco-deploy test")
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.close()
        return
    out.mkdir()
    (out / "config.json").write_text("{}")
    write_marker(out)


COMMANDS = ["prune", "compensate", "export-gguf", "export-onnx", "build", "imatrix"]
GGUF_FILES = ("export-gguf", "imatrix")  # commands whose --out is one GGUF file
# situation -> (what is at --out before, words of the one error line)
REFUSED = {
    "an existing user file": ("file", ("existing file",)),
    "a folder with user files": ("folder", ("did not write", "is a folder, and this writes a file")),
    "the current folder": ("cwd", ("current folder",)),
}


@pytest.mark.parametrize("situation", list(REFUSED))
@pytest.mark.parametrize("command", COMMANDS)
def test_refused_before_any_work_and_nothing_is_touched(cli, tiny_llama_dir, tmp_path, monkeypatch, no_work, command, situation):
    what, words = REFUSED[situation]
    root = tmp_path / "work"
    root.mkdir()
    monkeypatch.chdir(root)
    out = root / ("out.gguf" if command in GGUF_FILES else "out")
    if what == "file":
        out.write_text(PRECIOUS)
    sentinels = Sentinels(root, out, inside=what == "folder")
    if what == "cwd":
        if command == "build":
            pytest.skip("a build writes into its folder: `build --out .` in a folder of user files is the folder case")
        out = Path(".")
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    code, _, err = cli(*_args(command, tiny_llama_dir, out))
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: --out "), err
    assert any(w in err for w in words), err
    assert "choose another --out" in err or "name a new" in err, err
    assert sentinels.intact() == []
    if what == "file":
        assert out.read_text() == PRECIOUS
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before  # nothing made, moved or removed


@pytest.mark.parametrize("command", ["prune", "compensate", "export-gguf", "export-onnx", "imatrix"])
def test_an_earlier_output_needs_force(cli, tiny_llama_dir, tmp_path, monkeypatch, no_work, command):
    out = tmp_path / ("out.gguf" if command in GGUF_FILES else "out")
    _earlier_output(out, command)
    sentinels = Sentinels(tmp_path, out, inside=False)
    code, _, err = cli(*_args(command, tiny_llama_dir, out))
    assert code == 2 and "is an earlier laco-deploy output; pass --force to replace it" in err, err
    assert out.exists() and sentinels.intact() == []
    code, _, err = cli(*_args(command, tiny_llama_dir, out), "--force")
    assert code == 3 and "ran although --out was refused" in err  # --force lets it through to the work


@pytest.mark.parametrize("command", ["prune", "compensate", "export-onnx"])
def test_force_never_replaces_user_files_inside_an_earlier_output(cli, tiny_llama_dir, tmp_path, no_work, command):
    out = tmp_path / "out"
    _earlier_output(out, command)
    sentinels = Sentinels(tmp_path, out, inside=True)  # added after laco-deploy wrote the folder
    code, _, err = cli(*_args(command, tiny_llama_dir, out), "--force")
    assert code == 2 and "did not write (keep.txt, nested" in err, err
    assert sentinels.intact() == []


@pytest.mark.parametrize("command", ["prune", "compensate"])
def test_a_user_folder_named_like_the_checkpoints_is_refused(cli, tiny_llama_dir, tmp_path, no_work, command):
    ckpt = tmp_path / "out.ckpt"
    ckpt.mkdir()
    (ckpt / "mine.txt").write_text(PRECIOUS)
    code, _, err = cli(*_args(command, tiny_llama_dir, tmp_path / "out"))
    assert code == 2 and "out.ckpt" in err and "keeps its checkpoints" in err, err
    assert (ckpt / "mine.txt").read_text() == PRECIOUS


def test_a_build_reuses_its_own_folder_and_refuses_others(cli, tiny_llama_dir, tmp_path, no_work):
    old_build = tmp_path / "old"
    old_build.mkdir()
    (old_build / "manifest.json").write_text(json.dumps({"tool": "laco-deploy", "stages": {}}))
    code, _, err = cli(*_args("build", tiny_llama_dir, old_build))
    assert code == 3 and "the build ran" in err  # an earlier build folder (manifest) is built into again
    code, _, err = cli(*_args("build", tiny_llama_dir, tmp_path / "new"))
    assert code == 3 and "the build ran" in err and (tmp_path / "new" / MARKER).is_file()
    code, _, err = cli(*_args("build", tiny_llama_dir, tmp_path / "new"))
    assert code == 3 and "the build ran" in err  # marked when made: a build killed before its manifest resumes
    other = tmp_path / "theirs"
    other.mkdir()
    (other / "manifest.json").write_text('{"name": "someone else\'s"}')
    code, _, err = cli(*_args("build", tiny_llama_dir, other))
    assert code == 2 and "did not write (manifest.json) and is not a build folder" in err, err


@pytest.mark.parametrize("command", ["prune", "compensate", "export-gguf", "export-onnx", "imatrix"])
def test_real_runs_leave_every_sentinel_and_a_rerun_needs_force(cli, tiny_llama_dir, tmp_path, command):
    """Unpatched commands: the output appears beside untouched sentinels; a rerun is refused, --force replaces it."""
    out = tmp_path / ("out.gguf" if command in GGUF_FILES else "out")
    sentinels = Sentinels(tmp_path, out, inside=False)
    code, _, err = cli(*_args(command, tiny_llama_dir, out))
    assert code == 0, err
    assert out.exists() and sentinels.intact() == []
    assert not list(tmp_path.glob("*.partial")) and not (tmp_path / "out.ckpt").exists()
    first = out.stat().st_mtime_ns
    code, _, err = cli(*_args(command, tiny_llama_dir, out))
    assert code == 2 and "--force" in err and out.stat().st_mtime_ns == first
    code, _, err = cli(*_args(command, tiny_llama_dir, out), "--force")
    assert code == 0, err
    assert sentinels.intact() == [] and sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["neighbour.txt", f".{out.name}.old", "sub", out.name])


@pytest.mark.parametrize("case", ["a link", "a folder holding the current one", "a build folder as a model --out"])
def test_check_output_refuses_what_it_cannot_own(tmp_path, monkeypatch, case):
    from laco_deploy.errors import OutputError
    from laco_deploy.fsutil import check_output, mark_folder

    user = tmp_path / "user"
    user.mkdir()
    (user / "keep.txt").write_text(PRECIOUS)
    monkeypatch.chdir(user)
    if case == "a link":
        (tmp_path / "link").symlink_to(user)
        target, words = tmp_path / "link", "is a link"
    elif case == "a folder holding the current one":
        target, words = Path(".."), "a folder holding the current folder"
    else:
        target, words = mark_folder(tmp_path / "build"), "build or checkpoint folder"
        (target / "build.log").write_text("a build's log\n")
    with pytest.raises(OutputError, match=words):
        check_output(target, "--out", force=True, force_option="--force")
    assert (user / "keep.txt").read_text() == PRECIOUS


REPORTS = {  # command -> (arguments writing the record at OUT, what an earlier record of it holds)
    "compensate --json": (lambda tiny, out: ["compensate", "--dense", tiny, "--sparse", tiny, "--out", out.parent / "m",
                                             "--method", "none", "--json", out],
                          json.dumps({"model_dir": "m", "stage": "compensate", "sparsity": 0.5, "pattern": "2:4"})),
    "bench run --out": (lambda tiny, out: ["bench", "run", f"m={tiny}", "--runtime", "llama.cpp", "--out", out],
                        json.dumps({"runtime": "llama.cpp", "environment": {}, "protocol": {}, "models": {}})),
}


@pytest.mark.parametrize("command", list(REPORTS))
def test_result_records_replace_only_their_own_kind_with_force(cli, tiny_llama_dir, tmp_path, monkeypatch, no_work, command):
    monkeypatch.setattr(importlib.import_module("laco_deploy.targets").Target, "run_benchmark", _never("the benchmark"))
    args, earlier = REPORTS[command]
    out = tmp_path / "record.json"
    out.write_text('{"mine": true}\n')
    code, _, err = cli(*args(tiny_llama_dir, out), "--force")
    assert code == 2 and "existing file that laco-deploy did not write" in err, err
    assert out.read_text() == '{"mine": true}\n'
    out.write_text(earlier)
    code, _, err = cli(*args(tiny_llama_dir, out))
    assert code == 2 and "earlier laco-deploy output; pass --force" in err, err
    code, _, err = cli(*args(tiny_llama_dir, out), "--force")
    assert code == 3 and "ran although --out was refused" in err  # --force lets it through to the work


def test_compare_markdown_replaces_only_its_own_table(cli, tmp_path):
    result = tmp_path / "r.json"
    result.write_text(json.dumps({"suite": "ci", "metrics": {"ppl.laco": {"value": 30.0, "better": "lower", "rel": 0.1}}}))
    md = tmp_path / "cmp.md"
    md.write_text("# my notes\n")
    code, _, err = cli("bench", "compare", result, result, "--markdown", md, "--force")
    assert code == 2 and "did not write" in err and md.read_text() == "# my notes\n", err
    md.unlink()
    assert cli("bench", "compare", result, result, "--markdown", md)[0] == 0
    code, _, err = cli("bench", "compare", result, result, "--markdown", md)
    assert code == 2 and "--force" in err, err
    assert cli("bench", "compare", result, result, "--markdown", md, "--force")[0] == 0


FIDELITY = ["--eval-samples", "2", "--seqlen", "16", "--device", "cpu", "--no-layerwise"]


def test_fidelity_report_never_writes_over_a_users_folder(cli, tiny_llama_dir, tmp_path, monkeypatch):
    """--report writes fidelity.* inside a folder: a new or empty one, or one laco-deploy wrote (a report
    or build folder); a folder of the user's, even one holding a fidelity.md, is refused before any work."""
    def fidelity(report):
        return cli("fidelity", "--dense", tiny_llama_dir, "--candidate", f"same={tiny_llama_dir}", "--report", report, *FIDELITY)

    users = tmp_path / "mine"
    sentinels = Sentinels(tmp_path, users, inside=True)
    (users / "fidelity.md").write_text(PRECIOUS)
    real_run = importlib.import_module("laco_deploy.fidelity").run_checked
    monkeypatch.setattr(importlib.import_module("laco_deploy.fidelity"), "run_checked", _never("the fidelity run"))
    code, _, err = fidelity(users)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "--report" in err and "did not write" in err and "choose another --report" in err, err
    assert sentinels.intact() == [] and (users / "fidelity.md").read_text() == PRECIOUS
    assert sorted(p.name for p in users.iterdir()) == ["fidelity.md", "keep.txt", "nested"]

    monkeypatch.setattr(importlib.import_module("laco_deploy.fidelity"), "run_checked", real_run)
    ours = tmp_path / "report"
    for _ in range(2):  # made and marked by the first run; the second writes its reports again
        code, _, err = fidelity(ours)
        assert code == 0, err
        assert {p.name for p in ours.iterdir()} == {"fidelity.json", "fidelity.md", "fidelity.html", MARKER}
    assert sentinels.intact() == []


def test_report_folders_of_older_versions_and_builds_are_recognised(tmp_path):
    from laco_deploy.fidelity.report import is_report_folder
    from laco_deploy.fsutil import mark_folder

    old = tmp_path / "old"
    old.mkdir()
    (old / "fidelity.json").write_text(json.dumps({"schema_version": 1, "versions": {"laco_deploy": "0.1"}}))
    (old / "fidelity.md").write_text("| table |\n")
    assert is_report_folder(old) and is_report_folder(mark_folder(tmp_path / "build"))
    (old / "notes.txt").write_text(PRECIOUS)
    assert not is_report_folder(old)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "fidelity.json").write_text('{"mine": true}')
    assert not is_report_folder(theirs) and not is_report_folder(tmp_path / "missing")
