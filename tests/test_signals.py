"""Real signals to a running CLI: Ctrl-C (SIGINT) exits 130, SIGTERM 143; no output that looks
complete is left, the per-layer checkpoints are, and --resume finishes the job."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

# Runs the CLI with the layer walk paused before layer 1's checkpoint is saved (layer 0's is), and
# announces the pause through a marker file, so the signal always lands mid-run.
DRIVER = textwrap.dedent("""
    import signal, sys, time
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a background parent may have ignored it
    from pathlib import Path
    from laco_deploy.engine.checkpoint import LayerCheckpoints
    marker = Path(sys.argv[1])
    real = LayerCheckpoints.save
    def paused(self, i, layer, record):
        if i == 1:
            marker.write_text("paused")
            time.sleep(120)
        return real(self, i, layer, record)
    LayerCheckpoints.save = paused
    from laco_deploy.cli import main
    main(sys.argv[2:])
""")

# The CLI as a user's terminal starts it: SIGINT raises KeyboardInterrupt (not inherited as ignored).
DRIVER_PLAIN = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
                "from laco_deploy.cli import main; main(sys.argv[1:])")


def _interrupt(args: list[str], sig: int, tmp_path: Path) -> subprocess.CompletedProcess:
    marker = tmp_path / "paused"
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, str(marker), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not marker.exists():
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        assert time.monotonic() < deadline, "the run never reached layer 1"
        time.sleep(0.2)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_mid_prune_leaves_no_complete_looking_output(tiny_llama_dir, tmp_path, sig, code):
    out = tmp_path / "pruned"
    args = ["prune", "--model", str(tiny_llama_dir), "--method", "wanda", "--sparsity", "0.5",
            "--samples", "8", "--seqlen", "32", "--out", str(out)]
    res = _interrupt(args, sig, tmp_path)
    assert res.returncode == code, res.stderr[-2000:]
    assert "interrupted" in res.stderr and "--resume" in res.stderr
    assert not out.exists()
    ckpt = Path(str(out) + ".ckpt")
    assert (ckpt / "layer_000.safetensors").is_file() and not (ckpt / "layer_001.safetensors").exists()
    done = subprocess.run([sys.executable, "-c", "from laco_deploy.cli import main; main()", *args, "--resume"],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (out / "config.json").is_file()


# LaCo runs made long by their settings alone (nothing patched): a layer trains for seconds, or the
# final KL pass runs for many steps, so the signal lands inside a long training step.
TINY_LACO = ["--samples", "16", "--seqlen", "32", "--patience", "1000", "--device", "cpu"]
LONG_STEP = {"layer walk": ["--epochs", "40", "--final-kl-epochs", "0"], "final KL pass": ["--epochs", "1", "--final-kl-epochs", "200"]}
STOP_WITHIN_S = 10  # generous: the handler runs between two tensor ops, which take milliseconds here


@pytest.fixture(scope="module")
def tiny_pruned_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    sys.path.insert(0, str(Path(__file__).parent / "compensate"))
    from compensate_sparse import make_unstructured

    return make_unstructured(tiny_llama_dir, tmp_path_factory.mktemp("sig") / "pruned")


def _stop_when(args: list[str], ready, sig: int = signal.SIGINT):
    """Run the CLI, send `sig` once `ready(stderr so far)` holds; return (result, seconds from signal to exit)."""
    proc = subprocess.Popen([sys.executable, "-c", DRIVER_PLAIN, *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.extend(iter(lambda: proc.stderr.read(64), "")), daemon=True)
    reader.start()
    deadline = time.monotonic() + 300
    while not ready("".join(err)):
        assert proc.poll() is None, "the run ended before the signal: " + "".join(err)[-2000:]
        assert time.monotonic() < deadline, "the run never reached the point to interrupt"
        time.sleep(0.1)
    time.sleep(0.3)  # inside the long step
    assert proc.poll() is None, "the step was not long enough: " + "".join(err)[-2000:]
    t0 = time.monotonic()
    proc.send_signal(sig)
    try:
        proc.wait(timeout=120)
    finally:
        proc.kill()
    stopped_s = time.monotonic() - t0
    reader.join(10)
    return subprocess.CompletedProcess(proc.args, proc.returncode, "", "".join(err)), stopped_s


@pytest.mark.parametrize("phase", list(LONG_STEP))
def test_ctrl_c_stops_a_long_laco_step_within_seconds(tiny_llama_dir, tiny_pruned_dir, tmp_path, phase):
    """Exit 130 with one line, within seconds, no output that looks complete; an interrupted walk resumes
    from its checkpoints (layer 0 restored, not trained again) to the end."""
    out = tmp_path / "recovered"
    ckpt = Path(str(out) + ".ckpt")
    args = ["compensate", "--dense", str(tiny_llama_dir), "--sparse", str(tiny_pruned_dir), "--out", str(out),
            *TINY_LACO, *LONG_STEP[phase]]
    if phase == "layer walk":  # layer 0 checkpointed: layer 1 is training
        def ready(_err):
            return (ckpt / "layer_000.safetensors").is_file()
    else:
        def ready(err):
            return "final KL pass" in err
    neighbour = tmp_path / "neighbour.txt"  # a user's file beside --out: an interrupt never touches it
    neighbour.write_text("precious\n")
    res, stopped_s = _stop_when(args, ready)
    assert res.returncode == 130, res.stderr[-2000:]
    assert neighbour.read_text() == "precious\n"
    flat = " ".join(res.stderr.split())
    assert "interrupted: partial files were removed; rerun with --resume" in flat and "Traceback" not in flat, flat[-2000:]
    assert stopped_s < STOP_WITHIN_S, f"{phase}: {stopped_s:.1f} s from SIGINT to exit"
    assert not out.exists() and not list(tmp_path.glob("*.partial")) and not list(tmp_path.glob(".*.partial"))
    assert not [f for f in ckpt.rglob("*") if f.name in ("config.json", "model.safetensors")]  # nothing like a model
    if phase != "layer walk":
        return
    from safetensors.torch import load_file

    assert not (ckpt / "layer_001.safetensors").exists()
    layer0 = load_file(ckpt / "layer_000.safetensors")
    done = subprocess.run([sys.executable, "-c", DRIVER_PLAIN, *args, "--resume"],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (out / "model.safetensors").is_file() and not ckpt.exists()
    model = load_file(out / "model.safetensors")
    # restored, not trained again (no final KL pass here, which would train every layer afterwards)
    assert all(torch.equal(model[f"model.layers.0.{k}"], v) for k, v in layer0.items())


# In the quantizer's child process: llama.cpp's quantize call, made to take two minutes (it is one C call
# of tens of seconds on a real model), announcing itself through a marker file.
SLOW_QUANTIZE = textwrap.dedent("""
    import os, time
    import llama_cpp
    def slow(*args):
        open(os.environ["LACO_TEST_MARKER"], "w").close()
        time.sleep(120)
        return 1
    llama_cpp.llama_model_quantize = slow
""")


def test_ctrl_c_during_llama_cpp_quantization_stops_within_seconds(tiny_llama_dir, tmp_path, monkeypatch):
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(SLOW_QUANTIZE)
    marker = tmp_path / "quantizing"
    monkeypatch.setenv("LACO_TEST_MARKER", str(marker))
    out = tmp_path / "exports" / "model.gguf"
    out.parent.mkdir()
    driver = f"import sys; sys.path.insert(0, {str(hooks)!r}); " + DRIVER_PLAIN
    proc_args = ["export", "--model", str(tiny_llama_dir), "--target", "gguf", "--quant", "q4_k_m", "--out", str(out)]
    monkeypatch.setattr(sys.modules[__name__], "DRIVER_PLAIN", driver)
    res, stopped_s = _stop_when(proc_args, lambda _err: marker.is_file())
    assert res.returncode == 130, res.stderr[-2000:]
    assert "interrupted" in res.stderr and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert stopped_s < STOP_WITHIN_S, f"{stopped_s:.1f} s from SIGINT to exit"
    assert list(out.parent.iterdir()) == []  # no .gguf, no partial file, no F32 work folder
