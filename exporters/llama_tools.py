"""llama.cpp's own `llama-quantize`, built from the sources the installed llama-cpp-python vendors.

The Python binding exposes llama.cpp's quantizer but not its tools' file readers; `llama-quantize
--imatrix FILE` is the reference reader of importance-matrix files, so tests and benchmarks compare
against it. The binary is compiled once per llama-cpp-python version (only the llama-quantize target,
CPU only, static libraries: a few minutes on 2 cores) into the user's cache:

    <cache_dir()>/llama.cpp-<version>/llama-quantize     ($LACO_LLAMA_QUANTIZE overrides the path)

    python -m exporters.llama_tools          # build it (or say where it is)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from laco_deploy.errors import ExportError
from laco_deploy.fsutil import atomic_path

ENV = "LACO_LLAMA_QUANTIZE"
PACKAGE = "llama-cpp-python"


def _version() -> str:
    try:
        import llama_cpp
    except ImportError as e:
        raise ExportError(f"llama-quantize is built from the installed {PACKAGE}'s sources; pip install {PACKAGE}") from e
    return llama_cpp.__version__


def quantize_path() -> Path:
    """Where the llama-quantize binary for the installed llama-cpp-python lives (or would)."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV]).expanduser()
    from laco_deploy.models import cache_dir

    return cache_dir() / f"llama.cpp-{_version()}" / "llama-quantize"


def find_quantize() -> Path | None:
    """The built llama-quantize binary, or None (build it with `python -m exporters.llama_tools`)."""
    path = quantize_path()
    return path if path.is_file() and os.access(path, os.X_OK) else None


def _run(cmd: list[str], log: Path, cwd: Path | None = None) -> None:
    with log.open("a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        rc = subprocess.run(cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-15:])
        raise ExportError(f"building llama-quantize failed at `{' '.join(cmd[:3])} ...` (exit {rc}); needs cmake, a C++ "
                          f"compiler and PyPI access for the {PACKAGE} sdist. Log {log}:\n{tail}")


def _sdist(version: str, work: Path, log: Path) -> Path:
    """The llama-cpp-python source archive of `version` (pip's own client fetches it)."""
    _run([sys.executable, "-m", *"pip download --quiet --no-binary :all: --no-deps".split(), f"{PACKAGE}=={version}",
          "-d", str(work)], log)
    found = sorted(work.glob("llama_cpp_python-*.tar.gz"))
    if not found:
        raise ExportError(f"pip download of {PACKAGE}=={version} left no sdist in {work}; see {log}")
    return found[0]


def build_quantize(jobs: int | None = None, sdist: Path | None = None) -> Path:
    """Compile llama-quantize from the installed llama-cpp-python's vendored llama.cpp; -> its path.
    `sdist`: a llama-cpp-python source archive of that version (default: pip downloads it)."""
    if shutil.which("cmake") is None:
        raise ExportError("building llama-quantize needs cmake: pip install cmake (or apt-get install cmake)")
    dest = quantize_path()
    version = _version()
    dest.parent.mkdir(parents=True, exist_ok=True)
    log = dest.parent / "build.log"
    log.write_text("")
    with tempfile.TemporaryDirectory(prefix="llama-quantize-") as tmp:
        work = Path(tmp)
        archive = Path(sdist) if sdist is not None else _sdist(version, work, log)
        with tarfile.open(archive) as tar:
            tar.extractall(work, filter="data")
        src = next(work.glob("llama_cpp_python-*/vendor/llama.cpp"), None)
        if src is None or not (src / "tools" / "quantize").is_dir():
            raise ExportError(f"{archive} holds no vendor/llama.cpp/tools/quantize; pass the {PACKAGE}=={version} sdist")
        build = work / "build"
        _run(["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF",
              "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
              "-DLLAMA_BUILD_SERVER=OFF", "-DGGML_OPENMP=OFF"], log)
        _run("cmake --build {} --target llama-quantize -j {}".format(build, jobs or os.cpu_count() or 1).split(), log)
        binary = next(build.rglob("llama-quantize"), None)
        if binary is None or not binary.is_file():
            raise ExportError(f"the llama-quantize build finished without a binary; see {log}")
        with atomic_path(dest) as out:
            shutil.copy2(binary, out)
    dest.chmod(0o755)  # the atomic write gives a data file's mode
    return dest


if __name__ == "__main__":  # a script entry: prints the binary's path
    found = find_quantize()
    if found is None:
        args = sys.argv[1:]
        found = build_quantize(sdist=Path(args[0]) if args else None)
    print(found)
