"""Rebuild the builtin corpus (laco_deploy/data/builtin/) from the Wikipedia sample in gensim's wheel.

The gensim wheel ships ~100 English Wikipedia articles as a MediaWiki XML dump (CC BY-SA 3.0).
This script strips the wiki markup to plain paragraphs and splits the articles into disjoint
calibration and evaluation sets (every 4th article -> evaluation), so calibration never sees
evaluation text. Run once by hand:  python tools/make_builtin_corpus.py path/to/gensim-*.whl
"""

from __future__ import annotations

import bz2
import html
import re
import sys
import zipfile
from pathlib import Path

DUMP = "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
OUT = Path(__file__).resolve().parents[1] / "laco_deploy" / "data" / "builtin"
MIN_ARTICLE_CHARS = 2000


def _strip_nested(text: str, open_: str, close: str) -> str:
    """Remove balanced {{...}} / {|...|} blocks, which regexes cannot match when nested."""
    out, depth, i = [], 0, 0
    while i < len(text):
        if text.startswith(open_, i):
            depth += 1
            i += len(open_)
        elif depth and text.startswith(close, i):
            depth -= 1
            i += len(close)
        else:
            if not depth:
                out.append(text[i])
            i += 1
    return "".join(out)


def clean_wikitext(text: str) -> str:
    text = html.unescape(text)
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    text = re.sub(r"<ref[^>/]*/>", "", text)
    text = re.sub(r"<ref.*?</ref>", "", text, flags=re.S)
    text = _strip_nested(text, "{{", "}}")
    text = _strip_nested(text, "{|", "|}")
    text = re.sub(r"\[\[(?:File|Image|Category):[^\[\]]*(?:\[\[[^\]]*\]\][^\[\]]*)*\]\]", "", text)
    text = re.sub(r"\[\[[a-z\-]{2,12}:[^\]]*\]\]", "", text)  # interlanguage links
    text = re.sub(r"\[\[([^\]|]*)\|([^\]]*)\]\]", r"\2", text)
    text = re.sub(r"\[\[([^\]]*)\]\]", r"\1", text)
    text = re.sub(r"\[https?://\S+ ([^\]]*)\]", r"\1", text)
    text = re.sub(r"\[https?://\S+\]", "", text)
    text = re.sub(r"<[^>]+>", "", text)
    text = re.sub(r"'{2,}", "", text)
    paragraphs = []
    for line in text.splitlines():
        line = line.strip()
        heading = re.fullmatch(r"=+\s*(.*?)\s*=+", line)
        if heading:
            if heading.group(1).lower() in {"references", "external links", "see also", "further reading", "notes"}:
                break  # the rest of an article is link lists
            continue
        if not line or line[0] in "*#:;|!{" or len(line) < 80:
            continue
        paragraphs.append(re.sub(r"\s+", " ", line))
    return "\n".join(paragraphs)


def main(wheel: str) -> None:
    raw = bz2.decompress(zipfile.ZipFile(wheel).read(DUMP)).decode("utf-8")
    articles = []
    for page in re.findall(r"<page>(.*?)</page>", raw, flags=re.S):
        title = re.search(r"<title>(.*?)</title>", page).group(1)
        body = re.search(r"<text[^>]*>(.*?)</text>", page, flags=re.S)
        if body is None or "#REDIRECT" in body.group(1)[:50].upper():
            continue
        text = clean_wikitext(body.group(1))
        if len(text) >= MIN_ARTICLE_CHARS:
            articles.append((html.unescape(title), text))
    OUT.mkdir(parents=True, exist_ok=True)
    calib = [a for i, a in enumerate(articles) if i % 4 != 3]
    evals = [a for i, a in enumerate(articles) if i % 4 == 3]
    for name, part in (("calibration.txt", calib), ("evaluation.txt", evals)):
        # one article per block, separated by a blank line; the title is the block's first line
        (OUT / name).write_text("\n\n".join(f"{t}\n{x}" for t, x in part) + "\n", encoding="utf-8")
        print(name, len(part), "articles", sum(len(x) for _, x in part), "chars")


if __name__ == "__main__":
    main(sys.argv[1])
