"""Rebuild laco_deploy/data/domains/dialogue.jsonl, the conversational evaluation text, from the
chatterbot-corpus 1.3.3 wheel on PyPI (BSD-3-Clause; attribution in data/domains/ATTRIBUTION.md).

A register far from Wikipedia and from the other shipped texts: short, informal two-party chat
(greetings, small talk, jokes, opinions, trivia, tech support). Each English topic file but coding.yml
becomes one document; each conversation is its turns on alternating `User:` / `Assistant:` lines
(the corpus's own order: the first line is the user's), conversations separated by a blank line;
a conversation repeated verbatim is kept once.
Plain speaker labels rather than one model's chat template, so every model reads the same text.
For EVALUATION only (never calibration).

Usage (run by hand, once; the output depends only on the wheel):
    pip download --no-deps chatterbot-corpus==1.3.3 -d /tmp/src
    python tools/make_dialogue_corpus.py /tmp/src/chatterbot_corpus-1.3.3-py2.py3-none-any.whl
"""

from __future__ import annotations

import hashlib
import json
import sys
import zipfile
from pathlib import Path

import yaml

OUT = Path(__file__).resolve().parents[1] / "laco_deploy" / "data" / "domains" / "dialogue.jsonl"
WHEEL_SHA256 = "86de5300afb9a80826386339d3bec79c0a72eb0358abb8327e2ecef5ae0ce154"
PREFIX = "chatterbot_corpus/data/english/"
SPEAKERS = ("User", "Assistant")
# coding.yml is mostly code blocks: the shipped `code` text and the default calibration cover that genre
LEFT_OUT = ("coding.yml",)


def document(name: str, raw: bytes, seen: set[str]) -> dict[str, str]:
    """One topic file as a document; a conversation already seen (in any file) is left out: some files
    repeat generated exchanges many times, which a model could copy from its context window."""
    doc = yaml.safe_load(raw.decode("utf-8"))
    blocks = []
    for conversation in doc.get("conversations") or []:
        turns = [str(t).strip() for t in conversation if str(t).strip()]  # YAML already folded plain lines
        block = "\n".join(f"{SPEAKERS[i % 2]}: {t}" for i, t in enumerate(turns))
        if len(turns) >= 2 and block not in seen:
            seen.add(block)
            blocks.append(block)
    return {"text": "\n\n".join(blocks), "source": f"chatterbot-corpus 1.3.3 {PREFIX}{name}"}


def main(wheel: str) -> None:
    data = Path(wheel).read_bytes()
    if hashlib.sha256(data).hexdigest() != WHEEL_SHA256:
        sys.exit(f"{wheel} is not the chatterbot-corpus 1.3.3 wheel this text was made from (sha256 differs)")
    with zipfile.ZipFile(wheel) as z:
        names = sorted(n for n in z.namelist() if n.startswith(PREFIX) and n.endswith(".yml")
                       and n[len(PREFIX):] not in LEFT_OUT)
        seen: set[str] = set()
        docs = [document(n[len(PREFIX):], z.read(n), seen) for n in names]
    docs = [d for d in docs if d["text"]]
    OUT.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs), encoding="utf-8")
    chars = sum(len(d["text"]) for d in docs)
    print(f"wrote {OUT}: {len(docs)} documents, {chars} characters")


if __name__ == "__main__":
    main(sys.argv[1])
