"""Real signals to a running CLI: Ctrl-C (SIGINT) exits 130, SIGTERM 143; no output that looks
complete is left, the per-layer checkpoints are, and --resume finishes the job."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

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
