"""Rebuild the out-of-domain evaluation texts (laco_deploy/data/domains/) from package files.

The builtin corpus is Wikipedia only, so a pruned model can look fine there and still have lost
other skills. These three texts, each from a domain unlike Wikipedia, are for EVALUATION only
(never calibration):

- fiction.jsonl  "Botchan" by Natsume Soseki, English translation (1918), public domain in the US;
                 `test/botchan.txt` of the sentencepiece 0.2.0 source distribution.
- techdoc.jsonl  the Python language reference as plain text, CPython 3.11.7
                 `Lib/pydoc_data/topics.py` (PSF licence).
- code.jsonl     whole CPython 3.11.7 standard-library modules (`Lib/*.py`, PSF licence).

Format: JSON Lines, one document per line, {"text": ..., "source": ...}; laco_deploy.data reads
the "text" field. Not `.txt`, because that format splits documents at blank lines, and code and
documentation have blank lines inside a document; JSON keeps each document whole, byte for byte.

Usage (run by hand, once; the output depends only on the two inputs):
    pip download --no-binary :all: --no-deps sentencepiece==0.2.0 -d /tmp/src
    python3.11 tools/make_domain_corpora.py /tmp/src/sentencepiece-0.2.0.tar.gz [CPYTHON_LIB_DIR]
CPYTHON_LIB_DIR defaults to the running interpreter's standard library; it must be CPython 3.11.7's
`Lib/` (an installed 3.11.7 or the `Lib/` folder of Python-3.11.7.tgz from python.org).
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import sys
import sysconfig
import tarfile
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "laco_deploy" / "data" / "domains"
BOTCHAN = "sentencepiece-0.2.0/test/botchan.txt"
CPYTHON = "3.11.7"
# Pure-Python modules with plenty of English comments and docstrings, no generated tables.
CODE_MODULES = (
    "bisect.py", "contextlib.py", "copy.py", "csv.py", "fractions.py", "functools.py",
    "graphlib.py", "heapq.py", "json/decoder.py", "json/encoder.py", "numbers.py", "pprint.py",
    "queue.py", "sched.py", "shlex.py", "statistics.py", "string.py", "textwrap.py",
)
# A pydoc topic is dropped when this share of its paragraphs already appears in a longer topic
# ("if" is a section of "compound"): evaluation text should not repeat itself.
TOPIC_OVERLAP = 0.3
WRAP = 72  # the Gutenberg text is hard-wrapped at about this width
SHORT = 62  # a line this short (with the next word) broke on purpose: no false breaks in the book
CHAPTER = re.compile(r"CHAPTER [IVX]+\.?")


# --- fiction -----------------------------------------------------------------------------------


def _book_lines(raw: str) -> list[str]:
    """The novel's lines: Gutenberg header, credits, transcriber's notes and licence dropped.

    Gutenberg's licence (section 1.C) lets a public-domain text be redistributed freely once all
    references to Project Gutenberg are removed, which this does.
    """
    lines = raw.lstrip("\ufeff").replace("\r\n", "\n").split("\n")
    start = next(i for i, x in enumerate(lines) if x.startswith("*** START OF")) + 1
    end = next(i for i, x in enumerate(lines) if x.strip() == "--(THE END)--") + 1
    body = [x for x in lines[start:end] if not x.startswith("Produced by")]
    return [x.rstrip() for x in body if x.strip()]


def _ends_paragraph(line: str, nxt: str) -> bool:
    """Whether a hard-wrapped line ends a paragraph (the file lost its blank lines).

    The next word would have fitted on a short line, so the line broke on purpose; between SHORT
    and WRAP columns that alone is ambiguous, so the line must also end a sentence.
    """
    if CHAPTER.fullmatch(nxt):
        return True
    fit = len(line) + 1 + len(nxt.split()[0])
    if fit <= SHORT:
        return True
    return fit <= WRAP and re.search(r"[.!?\"')\]]$", line) is not None


def _paragraphs(lines: list[str]) -> list[str]:
    paras, cur = [], []
    for i, line in enumerate(lines):
        cur.append(line.strip())
        if i + 1 == len(lines) or _ends_paragraph(line, lines[i + 1]):
            paras.append(" ".join(cur))
            cur = []
    return paras


def fiction_docs(sdist: str) -> list[dict]:
    """Front matter and each chapter as one document; paragraphs one per line, as in builtin/."""
    with tarfile.open(sdist) as tar:
        raw = tar.extractfile(BOTCHAN).read().decode("utf-8")
    # transcriber's typo markers ("insistent.[A]", "([D])") point into notes that are dropped
    text = "\n".join(_book_lines(raw))
    text = re.sub(r" ?\(\[[A-Z]\]\)", "", text)
    text = re.sub(r"\[[A-Z]\]", "", text)
    docs, cur = [], []
    for para in _paragraphs(text.split("\n")):
        if CHAPTER.fullmatch(para) and cur:
            docs.append(cur)
            cur = []
        cur.append(para)
    docs.append(cur)
    return [{"text": "\n".join(d), "source": f"{BOTCHAN} part {n}"} for n, d in enumerate(docs)]


# --- technical documentation -------------------------------------------------------------------


def _topics(lib: Path) -> dict[str, str]:
    """The `topics` dict of pydoc_data/topics.py, read as a literal (the file is never executed)."""
    tree = ast.parse((lib / "pydoc_data" / "topics.py").read_text(encoding="utf-8"))
    assign = next(n for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "topics")
    return ast.literal_eval(assign.value)


def techdoc_docs(lib: Path) -> list[dict]:
    """One document per language-reference topic, longest first kept, sections of others dropped."""
    topics = _topics(lib)
    paras = {k: {p.strip() for p in v.split("\n\n") if len(p.strip()) > 40} for k, v in topics.items()}
    kept: list[str] = []
    seen: set[str] = set()
    for key in sorted(topics, key=lambda k: (-len(topics[k]), k)):
        if len(paras[key] & seen) > TOPIC_OVERLAP * max(1, len(paras[key])):
            continue
        kept.append(key)
        seen |= paras[key]
    return [{"text": topics[k].strip(), "source": f"Lib/pydoc_data/topics.py [{k!r}]"} for k in sorted(kept)]


# --- code --------------------------------------------------------------------------------------


def code_docs(lib: Path, modules: tuple[str, ...] = CODE_MODULES) -> list[dict]:
    """Each module's source whole and unchanged (trailing newline aside), one document per file."""
    return [{"text": (lib / m).read_text(encoding="utf-8").strip(), "source": f"Lib/{m}"} for m in modules]


# --- output ------------------------------------------------------------------------------------


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _write_jsonl(name: str, docs: list[dict], out: Path = OUT) -> None:
    # ensure_ascii=False keeps the file readable; json still escapes control characters, so a
    # document never spans two lines
    data = "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs).encode("utf-8")
    _write_atomic(out / name, data)
    chars = sum(len(d["text"]) for d in docs)
    print(f"{name}: {len(docs)} documents, {chars} chars, sha256 {hashlib.sha256(data).hexdigest()[:16]}")


def stdlib_dir(lib_dir: str | None) -> Path:
    """CPython 3.11.7's Lib/: the given folder, else the running interpreter's (which must be 3.11.7)."""
    if lib_dir is None and sys.version.split()[0] != CPYTHON:
        sys.exit(f"running Python {sys.version.split()[0]}; run with CPython {CPYTHON} or pass its Lib/ folder")
    return Path(lib_dir or sysconfig.get_paths()["stdlib"])


def main(sdist: str, lib_dir: str | None = None) -> None:
    lib = stdlib_dir(lib_dir)
    OUT.mkdir(parents=True, exist_ok=True)
    _write_jsonl("fiction.jsonl", fiction_docs(sdist))
    _write_jsonl("techdoc.jsonl", techdoc_docs(lib))
    _write_jsonl("code.jsonl", code_docs(lib))
    # the PSF licence asks that its text travel with copies of CPython's files; an install keeps
    # it as Lib/LICENSE.txt, a source tree as LICENSE next to Lib/
    licence = lib / "LICENSE.txt" if (lib / "LICENSE.txt").is_file() else lib.parent / "LICENSE"
    _write_atomic(OUT / "LICENSE-PSF.txt", licence.read_bytes())


if __name__ == "__main__":
    main(*sys.argv[1:3])
