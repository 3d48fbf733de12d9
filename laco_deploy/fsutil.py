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
_SHORT_WRITE = re.compile(r"\b\d+ requested and \d+ written\b")


def disk_full(e: BaseException) -> bool:
    """Whether `e` (or what caused it) is a full disk, also when a library wraps the OS error in
    its own exception (safetensors: `SafetensorError: ... No space left on device (os error 28)`)."""
    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, OSError) and e.errno in _DISK_FULL:
            return True
        if "No space left on device" in str(e) or "Disk quota exceeded" in str(e):
            return True
        if isinstance(e, OSError) and e.errno is None and _SHORT_WRITE.search(str(e)):
            return True  # numpy's tofile (the gguf writer): a short write without errno, which a full disk causes
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


def output_error(target: Path, e: OSError, option: str = "output path", folder: Path | None = None) -> LacoError | None:
    """The one-line user error for an OSError met while writing `target` (new files go into `folder`,
    default: the nearest existing folder above it), or None when the error is not the user's to fix."""
    folder = folder or _existing_ancestor(Path(target).parent)
    code = e.errno if e.errno is not None or not disk_full(e) else errno.ENOSPC
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
        full = e.errno is None and disk_full(e)
        mapped = output_error(target, e, option, folder) if codes is None or e.errno in codes or full else None
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


MARKER = ".laco-deploy.json"  # in every folder written by atomic_dir: the files laco-deploy put there


def write_marker(folder: Path) -> None:
    """Record in `folder` that laco-deploy wrote it and which files it holds, so a later run can tell
    its own output (which it may replace) from a user's folder (which it never touches)."""
    from laco_deploy import __version__

    files = sorted(str(f.relative_to(folder)) for f in Path(folder).rglob("*") if f.is_file() and f.name != MARKER)
    (Path(folder) / MARKER).write_text(json.dumps({"tool": "laco-deploy", "version": __version__, "files": files}) + "\n")


def _marked_files(folder: Path) -> set[str] | None:
    """The files the marker of `folder` lists, or None when laco-deploy did not write the folder."""
    try:
        doc = json.loads((folder / MARKER).read_text())
        return set(doc["files"]) if doc.get("tool") == "laco-deploy" else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _names(paths: list[str]) -> str:
    return ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")


def check_output(path: Path | None, option: str = "output path", *, force: bool = False, kind: str = "folder",
                 made_here: Any = None, force_option: str = "the force option", into_what: str = "build") -> None:
    """Refuse, before any work, an output path whose replacement could destroy what laco-deploy did not write.

    kind "folder" (a model folder, an ONNX export) or "file" (a .gguf): `path` is replaced whole, so it
    must be new, an empty folder, or an earlier laco-deploy output (a folder with its marker and no other
    files; a file `made_here(path)` recognises) and then only with `force`. Never the current folder
    or one holding it. kind "into" (a build folder): files are written inside `path`, which must be new,
    empty, or pass `made_here(path)`. The message names the path and the choices (`option`, and
    `force_option`, the caller's name for `force`; `into_what`, what kind "into" accepts); nothing is changed.
    """
    if path is None:
        return
    path = Path(path)
    here, where = Path.cwd(), Path(os.path.abspath(path))
    if kind != "into" and (where == here or where in here.parents):
        what = "the current folder" if where == here else "a folder holding the current folder"
        raise OutputError(f"{option} {path} is {what}, which laco-deploy would replace whole; "
                          f"name a new {'file' if kind == 'file' else 'folder'} instead, e.g. {option} ./out")
    if path.is_symlink():
        raise OutputError(f"{option} {path} is a link; laco-deploy does not replace links: choose another {option}")
    if path.exists():
        _check_existing(path, option, force=force, kind=kind, made_here=made_here, force_option=force_option,
                        into_what=into_what)
    check_writable(path, option, into=kind == "into")


def _check_existing(path: Path, option: str, *, force: bool, kind: str, made_here: Any, force_option: str,
                    into_what: str) -> None:
    keep = f"choose another {option}; laco-deploy replaces only its own outputs (nothing was changed)"
    if kind == "file":
        if path.is_dir():
            raise OutputError(f"{option} {path} is a folder, and this writes a file there; {keep}")
        if not (made_here and made_here(path)):
            raise OutputError(f"{option} {path} is an existing file that laco-deploy did not write; {keep}")
    elif not path.is_dir():
        raise OutputError(f"{option} {path} is an existing file, and this writes a folder there; {keep}")
    else:
        present = sorted(str(f.relative_to(path)) for f in path.rglob("*") if f.name != MARKER)
        if not present:
            return  # an empty folder holds nothing to lose
        if kind == "into":
            if made_here and made_here(path):
                return
            raise OutputError(f"{option} {path} holds files that laco-deploy did not write ({_names(present)}) and is "
                              f"not a {into_what} folder; choose another {option}: a new or empty folder, or an earlier "
                              f"{into_what} folder (nothing was changed)")
        listed = _marked_files(path)
        if listed is not None and not listed:  # mark_folder's: a build or checkpoint folder, not an output
            raise OutputError(f"{option} {path} is a laco-deploy build or checkpoint folder, which this does not "
                              f"replace; choose another {option} (nothing was changed)")
        foreign = [f for f in present if listed is None or (f not in listed and not (path / f).is_dir())]
        if foreign:
            raise OutputError(f"{option} {path} holds files that laco-deploy did not write ({_names(foreign)}); {keep}")
    if not force:
        raise OutputError(f"{option} {path} is an earlier laco-deploy output; pass {force_option} to replace it, "
                          f"or choose another {option}")


def check_scratch(folder: Path, option: str = "output path") -> None:
    """Refuse a checkpoint folder beside an output (`OUT.ckpt`, removed when the run ends) that
    laco-deploy did not make: a user's folder of that name is never cleared."""
    folder = Path(folder)
    ours = (folder / MARKER).is_file() or (folder / "meta.json").is_file()  # meta.json: checkpoints of older versions
    if folder.is_symlink() or (folder.exists() and not folder.is_dir()) or (folder.is_dir() and any(folder.iterdir()) and not ours):
        raise OutputError(f"{folder}, where a run with {option} keeps its checkpoints, holds files laco-deploy did not "
                          f"write; move it away or choose another {option} (nothing was changed)")


def is_marked(folder: Path) -> bool:
    """Whether laco-deploy made `folder` (an output, a build or checkpoint folder)."""
    return _marked_files(Path(folder)) is not None


def mark_folder(folder: Path) -> Path:
    """Create a folder laco-deploy writes into (checkpoints, a build) and mark it as its own, so that a
    rerun may resume in it, clear it or build into it again."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / MARKER).is_file():
        write_json(folder / MARKER, {"tool": "laco-deploy", "files": [], "workspace": True})
    return folder


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
            write_marker(tmp)
        with user_errors(target):
            os.chmod(tmp, 0o777 & ~_umask())
            if target.is_symlink() or (target.exists() and not target.is_dir()):
                raise OutputError(f"{target} is a file or link, not a folder laco-deploy wrote; choose another output path")
            if target.exists():
                # the old folder goes to a name of this process's own (a user's `.NAME.old` is never touched)
                old = tmp.with_name(tmp.name.removesuffix(".partial") + "-old.partial")
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


_HASHES: dict[tuple, str] = {}  # this process's file hashes by (path, inode, size, mtime): a build hashes its model once


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    st = os.stat(path)
    seen = (os.path.realpath(path), st.st_ino, st.st_size, st.st_mtime_ns)
    if seen not in _HASHES:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(chunk):
                h.update(block)
        _HASHES[seen] = h.hexdigest()
    return _HASHES[seen]


def reuse_key(settings: dict[str, Any], inputs: dict[str, Any]) -> str:
    """The one reuse key: a hash of the settings, the inputs' content hashes and the laco-deploy
    version. A build stage is reused (stagecache.StageCache) and a walk's layer checkpoints are
    resumed (engine.checkpoint, from prune and compensate) only when it matches."""
    from laco_deploy import __version__

    return hashlib.sha256(json.dumps({"settings": settings, "inputs": inputs, "version": __version__},
                                     sort_keys=True, default=str).encode()).hexdigest()


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
