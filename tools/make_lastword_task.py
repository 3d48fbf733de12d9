"""Build the `laco_lastword` zero-shot task (laco_deploy/data/tasks/laco_lastword.{jsonl,yaml}).

A LAMBADA-style task: read a passage, predict the word that ends its last sentence. It is made
mechanically from the shipped EVALUATION texts only (never calibration): the builtin Wikipedia
evaluation articles (data/builtin/evaluation.txt), the novel (domains/fiction.jsonl) and the
Python language reference (domains/techdoc.jsonl). Code is left out: its "last word" is not prose.

An item is a sentence-final word of at least 4 letters, not a function word, preceded by a space,
that already occurs (same spelling, whole word) in the CONTEXT_WORDS words before it; the context is
those words, cut from the original text (line breaks kept). LAMBADA also asked humans to check that
the word can be guessed from the whole passage and not from the last sentence alone; that filter
cannot be replicated without people, and "occurs earlier in the passage" is only a mechanical
stand-in, so this is not LAMBADA and its numbers are not comparable with LAMBADA's.

Items do not overlap, and PER_DOMAIN are taken evenly spaced over each text's candidates, so the
output depends only on the shipped texts (no random numbers). Usage:
    python tools/make_lastword_task.py
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from laco_deploy.data import load_texts  # noqa: E402

OUT = ROOT / "laco_deploy" / "data" / "tasks"
NAME = "laco_lastword"
SOURCES = {"wikipedia": "builtin", "fiction": "builtin:fiction", "techdoc": "builtin:techdoc"}
PER_DOMAIN = 150  # 450 items: a binomial standard error of 2.2 points at 30% accuracy
CONTEXT_WORDS = 50  # LAMBADA passages average ~75 words with the target sentence; shorter keeps CPU scoring cheap
MIN_LETTERS = 4
# sentence-final word: a space, letters, then . ! or ? and the end of the line, a space or a closing quote
FINAL = re.compile(r"(?<= )([A-Za-z]+)(?=[.!?](?:$|\s|[\"'\u201d\u2019)]))", re.M)
FUNCTION_WORDS = frozenset(
    "also been does from have here into just like more most much must only other over same some such than "
    "that them then there these they this those very were what when where which while will with would your "
    "about after again could before being should their through under upon".split()
)


def _candidates(doc: str) -> list[tuple[int, int, str]]:
    """(context start, target start, target) for each acceptable sentence-final word of a document."""
    out = []
    for m in FINAL.finditer(doc):
        word, at = m.group(1), m.start(1)
        line_start = doc.rfind("\n", 0, at) + 1
        line = doc[line_start:doc.find("\n", at) if "\n" in doc[at:] else len(doc)]
        if len(word) < MIN_LETTERS or word.lower() in FUNCTION_WORDS or line[:1].isspace() or ">>>" in line:
            continue  # short or function word, or an indented code/grammar line of the techdoc
        before = [w for w in re.finditer(r"\S+", doc[:at])][-CONTEXT_WORDS:]
        if len(before) < CONTEXT_WORDS:
            continue  # too close to the document's start for a full context
        start = before[0].start()
        if re.search(rf"(?<![A-Za-z]){word}(?![A-Za-z])", doc[start:at - 1]):
            out.append((start, at, word))
    return out


def domain_items(domain: str, spec: str) -> list[dict]:
    """PER_DOMAIN non-overlapping items evenly spaced over one text's candidates, in text order."""
    pool = []
    for n, doc in enumerate(load_texts(spec, "eval")):
        end = -1
        for start, at, word in _candidates(doc):
            if start > end:  # no two items share text
                pool.append({"context": doc[start:at - 1], "target": word, "domain": domain,
                             "source": f"{spec} document {n}, character {at}"})
                end = at + len(word)
    if len(pool) < PER_DOMAIN:
        sys.exit(f"{domain}: only {len(pool)} candidates, fewer than {PER_DOMAIN}")
    step = len(pool) / PER_DOMAIN
    return [pool[int(i * step)] for i in range(PER_DOMAIN)]


def main() -> None:
    items = [item for domain, spec in SOURCES.items() for item in domain_items(domain, spec)]
    data = "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in items).encode("utf-8")
    path = OUT / f"{NAME}.jsonl"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    words = sum(len(d["context"].split()) for d in items) / len(items)
    print(f"{path.name}: {len(items)} items, {words:.0f} context words each, sha256 {hashlib.sha256(data).hexdigest()[:16]}")


if __name__ == "__main__":
    main()
