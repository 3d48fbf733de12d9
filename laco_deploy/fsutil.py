"""Atomic file and directory writes: a killed run never leaves a file that looks complete.

Temp names carry the writing process (`.NAME.<host>-<pid>.XXXX.partial`), so a later write of the
same target removes what a killed run (`kill -9`, power loss) left behind, and only that. OS errors a
user can fix (permission, read-only file system, missing folder, full disk) become one-line
LacoErrors naming the user's path; `check_writable` finds them before any slow work starts.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Any, Iterator

from laco_deploy.errors import LacoError, OutputError, ResourceError

log = logging.getLogger(__name__)

_HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]  # a shared folder may serve several hosts


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _existing_ancestor(path: Path) -> Path:
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def disk_full(e: BaseException) -> bool:
    """Whether `e` (or what caused it) is a full disk, also when a library wraps the OS error in
    its own exception (safetensors: `SafetensorError: ... No space left on device (os error 28)`)."""
    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, OSError) and e.errno in _DISK_FULL:
            return True
        if "No space left on device" in str(e) or "Disk quota exceeded" in str(e):
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


def output_error(target: Path, e: OSError, option: str = "output path", folder: Path | None = None) -> LacoError | None:
    """The one-line user error for an OSError met while writing `target` (new files go into `folder`,
    default: the nearest existing folder above it), or None when the error is not the user's to fix."""
    folder = folder or _existing_ancestor(Path(target).parent)
    code = e.errno
    if code in _DISK_FULL:
        return ResourceError(f"no space left on the device while writing {target}; free disk space or choose another {option}")
    if code in (errno.EACCES, errno.EPERM):
        return OutputError(f"cannot write {target}: no permission to create files in {folder}; "
                           f"choose another {option} or fix the folder's permissions")
    if code == errno.EROFS:
        return OutputError(f"cannot write {target}: {folder} is on a read-only file system; choose another {option} on a writable disk")
    if code == errno.ENOTDIR or (code == errno.ENOENT and not folder.is_dir()):
        return OutputError(f"cannot write {target}: {folder} is a file, not a folder; choose another {option}")
    if code == errno.ENOENT:
        missing = "" if folder == Path(os.path.abspath(Path(target).parent)) else f" ({Path(target).parent} cannot be created there)"
        return OutputError(f"cannot write {target}: {folder} does not accept new files{missing}; "
                           f"choose another {option} in a folder you can write")
    if code == errno.EISDIR:
        return OutputError(f"cannot write {target}: a folder of that name exists; choose another {option} or remove the folder")
    if code == errno.ENAMETOOLONG:
        return OutputError(f"cannot write {target}: the name is too long for the file system; choose a shorter {option}")
    return None


@contextlib.contextmanager
def user_errors(target: Path, option: str = "output path", codes: tuple[int, ...] | None = None,
                folder: Path | None = None) -> Iterator[None]:
    """Turn OS errors a user can fix (those in `codes`, default all) into their one-line LacoError."""
    try:
        yield
    except OSError as e:
        mapped = output_error(target, e, option, folder) if codes is None or e.errno in codes else None
        if mapped is None:
            raise
        raise mapped from e


def check_writable(path: Path | None, option: str = "output path", *, into: bool = False) -> None:
    """Fail fast, before slow work, when `path` cannot be written (None: no path given, nothing to check).

    `into=False`: `path` (file or folder) is created or replaced atomically, so its parent must take
    new files. `into=True`: files are written inside the folder `path` (a build or report folder).
    """
    if path is None:
        return
    path = Path(path)
    if into and path.exists() and not path.is_dir():
        raise OutputError(f"cannot write into {path}: it is a file, not a folder; choose another {option}")
    where = _existing_ancestor(path if into else path.parent)
    with user_errors(path, option, folder=where):
        if not where.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(where))
        fd, probe = tempfile.mkstemp(prefix=".laco-write-check.", dir=where)
        os.close(fd)
        os.unlink(probe)


def _alive(pid: int) -> bool:
    if pid == os.getpid() or os.name != "posix":
        return True  # without POSIX signals, never guess another process dead
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, owned by another user
        return True
    return True


def _size(p: Path) -> int:
    return p.stat().st_size if p.is_file() else sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def remove_stale_partials(target: Path) -> list[Path]:
    """Remove the temp files or folders of `target` left by killed runs on this host (their process is gone)."""
    target = Path(target)
    owner = re.compile(rf"^\.{re.escape(target.name)}\.{_HOST}-(\d+)\.[^.]+\.partial$")
    stale = [Path(p) for p in glob.glob(os.path.join(glob.escape(str(target.parent)), f".{glob.escape(target.name)}.*.partial"))
             if (m := owner.match(Path(p).name)) and not _alive(int(m[1]))]
    freed = 0
    for p in stale:
        with contextlib.suppress(OSError):
            freed += _size(p)
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    if stale:
        log.info("removed %s of %s left by %s (%.1f MiB)", "1 partial file" if len(stale) == 1 else f"{len(stale)} partial files",
                 target, "a killed run" if len(stale) == 1 else "killed runs", freed / 2**20)
    return stale


def _temp_prefix(target: Path) -> str:
    return f".{target.name}.{_HOST}-{os.getpid()}."


@contextlib.contextmanager
def atomic_path(target: Path) -> Iterator[Path]:
    """Yield a temp path in the target's folder; rename it onto `target` only on success."""
    target = Path(target)
    with user_errors(target):
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_partials(target)
        fd, tmp = tempfile.mkstemp(prefix=_temp_prefix(target), suffix=".partial", dir=target.parent)
        os.close(fd)
    tmp_path = Path(tmp)
    try:
        with user_errors(target, codes=_DISK_FULL):  # the block's own errors (reading inputs) stay its own
            yield tmp_path
        with user_errors(target):
            if tmp_path.exists():  # mkstemp makes 0600 files; give the result ordinary permissions
                os.chmod(tmp_path, 0o666 & ~_umask())
            os.replace(tmp_path, target)
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_dir(target: Path) -> Iterator[Path]:
    """Yield a temp directory beside `target`; swap it in only when the block succeeds."""
    target = Path(target)
    with user_errors(target):
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_partials(target)
        tmp = Path(tempfile.mkdtemp(prefix=_temp_prefix(target), suffix=".partial", dir=target.parent))
    try:
        with user_errors(target, codes=_DISK_FULL):
            yield tmp
        with user_errors(target):
            os.chmod(tmp, 0o777 & ~_umask())
            if target.exists():
                old = target.with_name(f".{target.name}.old")
                shutil.rmtree(old, ignore_errors=True)
                os.replace(target, old)
                os.replace(tmp, target)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_json(path: Path, data: Any) -> None:
    with atomic_path(Path(path)) as tmp:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")


def write_text(path: Path, text: str) -> None:
    with atomic_path(Path(path)) as tmp:
        tmp.write_text(text)


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_tree(path: Path) -> str:
    """Hash of a file, or of a directory's files (names and contents), for manifests and reuse."""
    path = Path(path)
    if path.is_file():
        return sha256_file(path)
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")):
        h.update(str(f.relative_to(path)).encode())
        h.update(sha256_file(f).encode())
    return h.hexdigest()
