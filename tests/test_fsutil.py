"""Atomic writes: unwritable outputs are one-line user errors naming the user's path, and partial
files left by killed runs (kill -9) are removed by the next write of the same target."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from laco_deploy import fsutil
from laco_deploy.errors import OutputError, ResourceError
from laco_deploy.fsutil import atomic_dir, atomic_path, check_writable, output_error, remove_stale_partials


@pytest.mark.parametrize("code,words", [
    (errno.EACCES, "no permission"),
    (errno.EPERM, "no permission"),
    (errno.EROFS, "read-only file system"),
    (errno.ENOENT, "does not accept new files"),
    (errno.ENOSPC, "no space left"),
])
def test_oserrors_a_user_can_fix_become_one_line_errors(tmp_path, code, words):
    target = tmp_path / "missing" / "model.gguf"
    err = output_error(target, OSError(code, os.strerror(code), str(tmp_path / ".model.gguf.x.partial")))
    assert isinstance(err, (OutputError, ResourceError)) and err.exit_code == 2
    text = str(err)
    assert words in text and str(target) in text and "output path" in text and ".partial" not in text
    assert "\n" not in text


def test_other_oserrors_stay_internal(tmp_path):
    assert output_error(tmp_path / "m.gguf", OSError(errno.EIO, "I/O error")) is None


def test_option_name_is_the_one_the_user_typed(tmp_path):
    err = output_error(tmp_path / "rep", OSError(errno.EACCES, "Permission denied"), "--report")
    assert "choose another --report" in str(err)


def test_check_writable_unwritable_parent():
    with pytest.raises(OutputError, match=r"cannot write /proc/forbidden\.gguf: /proc does not accept new files; choose another output path"):
        check_writable(Path("/proc/forbidden.gguf"))
    with pytest.raises(OutputError, match=r"/proc/forbidden cannot be created"):
        check_writable(Path("/proc/forbidden/model.gguf"))
    with pytest.raises(OutputError, match="--report"):
        check_writable(Path("/proc/forbidden"), "--report", into=True)


def test_check_writable_blocked_by_a_file(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputError, match="is a file, not a folder"):
        check_writable(tmp_path / "file" / "model.gguf")
    with pytest.raises(OutputError, match="is a file, not a folder"):
        check_writable(tmp_path / "file", into=True)


def test_check_writable_creates_nothing(tmp_path):
    check_writable(tmp_path / "new" / "deeper" / "model.gguf")
    check_writable(tmp_path / "build", into=True)
    check_writable(None)
    assert list(tmp_path.iterdir()) == []


def test_read_only_file_system_simulated(tmp_path, monkeypatch):
    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(tmp_path / ".m.gguf.abc.partial"))

    monkeypatch.setattr(fsutil.tempfile, "mkstemp", read_only)
    with pytest.raises(OutputError, match=r"read-only file system; choose another output path") as e:
        check_writable(tmp_path / "m.gguf")
    assert ".partial" not in str(e.value)
    with pytest.raises(OutputError, match=r"cannot write .*m\.gguf: .* read-only"):
        with atomic_path(tmp_path / "m.gguf") as tmp:
            tmp.write_text("never")


def test_atomic_write_to_unwritable_folder_names_the_users_path():
    with pytest.raises(OutputError) as e:
        with atomic_path(Path("/proc/forbidden.gguf")) as tmp:
            tmp.write_text("never")
    assert "/proc/forbidden.gguf" in str(e.value) and ".partial" not in str(e.value)
    assert isinstance(e.value.__cause__, OSError)


def test_errors_of_the_block_itself_are_not_blamed_on_the_output(tmp_path):
    with pytest.raises(FileNotFoundError):
        with atomic_path(tmp_path / "m.gguf"):
            open(tmp_path / "no-such-input")
    assert list(tmp_path.iterdir()) == []


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_partials_of_dead_processes_are_removed(tmp_path, caplog):
    target = tmp_path / "k.gguf"
    dead = _dead_pid()
    stale_file = tmp_path / f".k.gguf.{fsutil._HOST}-{dead}.abc123.partial"
    stale_file.write_bytes(b"x" * 1024)
    stale_dir = tmp_path / f".k.gguf.{fsutil._HOST}-{dead}.def456.partial"
    stale_dir.mkdir()
    (stale_dir / "weights").write_bytes(b"y")
    kept = [
        tmp_path / f".k.gguf.{fsutil._HOST}-{os.getpid()}.live.partial",  # a live process (this one) owns it
        tmp_path / f".k.gguf.0badc0de-{dead}.other.partial",  # another host's: its PID means nothing here
        tmp_path / f".kk.gguf.{fsutil._HOST}-{dead}.other.partial",  # another target
    ]
    for p in kept:
        p.write_text("keep")
    with caplog.at_level(logging.INFO, logger="laco_deploy.fsutil"):
        with atomic_path(target) as tmp:
            assert f"{fsutil._HOST}-{os.getpid()}" in tmp.name
            tmp.write_text("done")
    assert target.read_text() == "done"
    assert not stale_file.exists() and not stale_dir.exists() and all(p.exists() for p in kept)
    lines = [r.getMessage() for r in caplog.records if "partial" in r.getMessage()]
    assert len(lines) == 1 and f"removed 2 partial files of {target}" in lines[0]


def test_stale_partial_folder_removed_by_atomic_dir(tmp_path):
    stale = tmp_path / f".out.{fsutil._HOST}-{_dead_pid()}.x1.partial"
    stale.mkdir()
    with atomic_dir(tmp_path / "out") as tmp:
        (tmp / "config.json").write_text("{}")
    assert not stale.exists() and (tmp_path / "out" / "config.json").is_file()
    assert remove_stale_partials(tmp_path / "out") == []


# Exports the tiny model to GGUF and stops just before the rename, so SIGKILL leaves a full-size partial.
KILLED_EXPORT = textwrap.dedent("""
    import contextlib, sys, time
    from pathlib import Path
    import exporters.gguf as gguf_export
    marker = Path(sys.argv[1])
    real = gguf_export.atomic_path
    @contextlib.contextmanager
    def paused(target):
        with real(target) as tmp:
            yield tmp
            marker.write_text(str(tmp))
            time.sleep(300)
    gguf_export.atomic_path = paused
    from laco_deploy.cli import main
    main(sys.argv[2:])
""")


def test_kill_9_mid_export_then_rerun_leaves_no_partial(tiny_llama_dir, tmp_path):
    out = tmp_path / "k.gguf"
    args = ["export", "--model", str(tiny_llama_dir), "--target", "gguf", "--quant", "f32", "--out", str(out)]
    marker = tmp_path / "written"
    proc = subprocess.Popen([sys.executable, "-c", KILLED_EXPORT, str(marker), *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not marker.exists():
            assert proc.poll() is None, proc.communicate()[1][-2000:]
            assert time.monotonic() < deadline, "the export never reached its rename"
            time.sleep(0.2)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    partials = list(tmp_path.glob(".k.gguf.*.partial"))
    assert len(partials) == 1 and partials[0].stat().st_size > 0 and not out.exists()

    rerun = subprocess.run([sys.executable, "-c", "from laco_deploy.cli import main; main()", *args],
                           capture_output=True, text=True, check=False)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert out.is_file() and not list(tmp_path.glob("*.partial")) and not list(tmp_path.glob(".*.partial"))
    assert f"removed 1 partial file of {out} left by a killed run" in rerun.stderr


def test_a_library_wrapped_full_disk_is_a_user_error(monkeypatch, capsys):
    """safetensors reports ENOSPC as its own SafetensorError: still one line naming the fix, exit 2."""
    from laco_deploy import cli
    from laco_deploy.fsutil import disk_full

    wrapped = RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")
    assert disk_full(wrapped) and disk_full(OSError(errno.ENOSPC, "full")) and not disk_full(RuntimeError("other"))
    try:
        raise ValueError("outer") from OSError(errno.EDQUOT, "quota")
    except ValueError as e:
        assert disk_full(e)

    def full_disk(*a, **kw):
        raise wrapped

    monkeypatch.setattr(cli, "app", full_disk)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["version"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "no space left on the device" in err and "free disk space" in err and "internal error" not in err


def test_reuse_key_follows_settings_and_content_not_place(tmp_path):
    a, b = tmp_path / "a.bin", tmp_path / "elsewhere" / "a.bin"
    a.write_bytes(b"weights-1")
    b.parent.mkdir()
    b.write_bytes(b"weights-1")
    key = fsutil.reuse_key({"lr": 1}, {"model": fsutil.sha256_tree(a)})
    assert key == fsutil.reuse_key({"lr": 1}, {"model": fsutil.sha256_tree(b)})  # a moved copy resumes
    assert key != fsutil.reuse_key({"lr": 2}, {"model": fsutil.sha256_tree(a)})
    time.sleep(0.01)
    a.write_bytes(b"weights-2")  # same size, rewritten in place: the hash is read again
    assert fsutil.sha256_tree(a) != fsutil.sha256_tree(b)
    assert key != fsutil.reuse_key({"lr": 1}, {"model": fsutil.sha256_tree(a)})

