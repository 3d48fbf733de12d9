"""What reaches the terminal: by default only our lines; --verbose brings other libraries' detail back,
--quiet keeps warnings and errors; a build keeps the full detail in build.log; --json for scripts.

"Ours" (laco_deploy/cli/output.py): records of loggers under `laco_deploy` and `exporters`, the progress
bars of `laco_deploy.progress` (their names are listed below), and the lines the commands print.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from laco_deploy.cli import output
from laco_deploy.cli.output import Verbosity

# Every `desc=` given to laco_deploy.progress.progress_bar; the layer walk prefixes "layer i/n ".
OUR_BARS = {"prune", "LaCo", "final KL pass", "dense teacher", "owl outliers", "layers", "fidelity", "llama.cpp bench",
            "onnxruntime bench", "converting GGUF", "parity check"}
BAR = re.compile(r"^(?:layer \d+/\d+ )?(?P<desc>.+?): +\d+%\|")
RECORD = re.compile(r"^\d{4}-\d\d-\d\d [\d:,]+ (?P<level>[A-Z]+) (?P<name>[\w.]+): (?P<message>.*)$")
SMALL = """\
model: {device: cpu}
data: {samples: 6, seqlen: 32, eval_samples: 2}
compensate: {epochs: 1}
bench: {repetitions: 1, n_prompt: 16, n_gen: 4, ppl_ctx: 32, ppl_windows: 1}
"""


@pytest.fixture()
def restore_logging():
    yield
    output.configure(Verbosity.NORMAL)


def _emit() -> None:
    logging.getLogger("laco_deploy.prune.run").info("our info")
    logging.getLogger("exporters.gguf").warning("our warning")
    logging.getLogger("laco_deploy.cli").info("only for the build log", extra=output.FILE_ONLY)
    logging.getLogger("gguf.gguf_writer").info("their info")
    logging.getLogger("transformers.modeling_utils").warning("their warning")
    logging.getLogger("onnxruntime").error("their error")
    warnings.warn("a python warning", UserWarning, stacklevel=1)


@pytest.mark.parametrize("level,shown,hidden", [
    (Verbosity.NORMAL, ["our info", "warning: our warning", "error: onnxruntime: their error"],
     ["their info", "their warning", "a python warning", "only for the build log"]),
    (Verbosity.QUIET, ["warning: our warning", "error: onnxruntime: their error"],
     ["our info", "their info", "their warning", "a python warning"]),
    (Verbosity.VERBOSE, ["INFO laco_deploy.prune.run: our info", "INFO gguf.gguf_writer: their info",
                         "WARNING transformers.modeling_utils: their warning", "a python warning"], ["only for the build log"]),
])
def test_terminal_shows_by_verbosity(capsys, restore_logging, level, shown, hidden):
    with warnings.catch_warnings():  # pytest records warnings itself; let configure() route them in this block
        warnings.simplefilter("always")
        logging.captureWarnings(False)
        output.configure(level)
        _emit()
    err = capsys.readouterr().err
    for text in shown:
        assert text in err
    for text in hidden:
        assert text not in err


def test_build_log_keeps_everything(tmp_path, capsys, restore_logging):
    with warnings.catch_warnings(), output.log_file(tmp_path / "build.log") as path:
        warnings.simplefilter("always")
        logging.captureWarnings(False)
        output.configure(Verbosity.NORMAL)
        logging.getLogger("laco_deploy.pipeline").debug("our debug detail")
        _emit()
    logging.getLogger("laco_deploy.pipeline").info("after the block")
    text = path.read_text()
    for line in ("DEBUG laco_deploy.pipeline: our debug detail", "INFO laco_deploy.cli: only for the build log",
                 "INFO gguf.gguf_writer: their info", "WARNING py.warnings:", "a python warning"):
        assert line in text
    assert "after the block" not in text
    assert "their info" not in capsys.readouterr().err


def test_ours_are_the_laco_deploy_and_exporters_loggers():
    assert output.is_ours("laco_deploy") and output.is_ours("laco_deploy.runtimes.llamacpp_probe")
    assert output.is_ours("exporters.gguf")
    assert not output.is_ours("gguf.gguf_writer") and not output.is_ours("laco_deploy_extra") and not output.is_ours("py.warnings")


def _build(options: list[str], args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    """`laco-deploy --threads 1 OPTIONS build --config SMALL ARGS` in a fresh process."""
    config = tmp_path / "small.yaml"
    config.write_text(SMALL)
    cmd = [sys.executable, "-c", "from laco_deploy.cli import main; main()", "--threads", "1", *options, "build",
           "--config", str(config), *args]
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_DISABLE_PROGRESS_BARS", "TRANSFORMERS_VERBOSITY", "TORCH_LOGS")}
    return subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=900, env=env)  # a new user's environment


def _our_messages(build_log: Path) -> set[str]:
    return {m["message"] for line in build_log.read_text().splitlines()
            if (m := RECORD.match(line)) and output.is_ours(m["name"])}


def _not_ours(stderr: str, ours: set[str]) -> list[str]:
    """Each stderr line (progress bars redraw with \\r) that is neither our bar nor one of our messages."""
    strange = []
    for line in re.split(r"[\r\n]+", stderr):
        line = line.strip()
        if not line:
            continue
        bar = BAR.match(line)
        if bar and (bar["desc"] in OUR_BARS or bar["desc"].split()[0] in OUR_BARS):  # "fidelity gguf-q8_0"
            continue
        if re.sub(r"^(warning|error): ", "", line) in ours:
            continue
        strange.append(line)
    return strange


@pytest.fixture(scope="module")
def default_build(tiny_llama_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("default_output")
    res = _build([], ["--model", str(tiny_llama_dir), "--out", str(tmp / "b")], tmp)
    return res, tmp / "b"


def test_default_build_prints_only_our_lines(default_build):
    res, out = default_build
    assert res.returncode == 0, res.stderr[-3000:]
    log = out / "build.log"
    assert log.is_file()
    assert _not_ours(res.stderr, _our_messages(log)) == []
    assert "stage prune      running" in res.stderr and "stage bench      done" in res.stderr
    assert "build folder" in res.stdout and "stage prune" not in res.stdout  # progress on stderr, results on stdout
    detail = log.read_text()
    assert "gguf.gguf_writer" in detail and "transformers." in detail  # hidden from the terminal, kept in the file
    assert "Loading weights" not in res.stderr and "gguf_writer" not in res.stderr


def test_quiet_rerun_prints_no_progress(default_build, tiny_llama_dir, tmp_path):
    _, out = default_build
    res = _build(["--quiet"], ["--model", str(tiny_llama_dir), "--out", str(out)], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stderr.strip() == ""
    assert "build folder" in res.stdout
    assert "stage prune      reused" in (out / "build.log").read_text()


def test_verbose_brings_the_detail_back_and_json_goes_to_stdout(tiny_llama_dir, tmp_path):
    out = tmp_path / "b"
    res = _build(["--verbose"], ["--model", str(tiny_llama_dir), "--out", str(out), "--json"], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "INFO gguf.gguf_writer:" in res.stderr and "Loading weights" in res.stderr
    assert _not_ours(res.stderr, _our_messages(out / "build.log")) != []
    summary = json.loads(res.stdout)
    assert summary["build_folder"] == str(out) and summary["build_log"] == str(out / "build.log")
    assert summary["sparsity"] == pytest.approx(0.5, abs=0.01) and "stage_wall_s" in summary
