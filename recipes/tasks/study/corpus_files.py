"""The corpus as a small folder that travels: a machine without internet (the device tier's) cannot fetch the
sources, and the cached blocks (int64, about 120 MB) are too large to carry. `export_corpus` writes the blocks as
compressed uint16 (any vocabulary up to 65,536), the tokenizer and the pin; `load_exported` reads them back and
checks the blocks against the pin's digest.

    python recipes/study.py --preset device --export_corpus runs/corpus-vocab32768   # here: build (once) and export
    python recipes/study.py --preset device --corpus_dir runs/corpus-vocab32768      # there: train from it

The share ladder's three vocabularies would carry three sets of blocks (more than a device call takes), so its folder
holds the text once instead (`export_ladder`: the documents, xz-compressed) and each vocabulary's tokenizer and pin;
`load_ladder` cuts the blocks there, as the cache built them here, and checks them against the pin.
"""

from __future__ import annotations

import json
import lzma
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import transformers as tf

from untie_recipes.tasks.decision_map.corpus import TokenizedCorpus, cut_corpus, written_whole
from untie_recipes.tasks.study.provenance import blocks_digest

BLOCKS_FILE = "blocks-uint16.npz"
PIN_FILE = "pin.json"
#: The share ladder's text: the sources' documents in their fixed order, as a JSON list, xz-compressed.
LADDER_TEXT = "documents.json.xz"


def export_corpus(corpus: TokenizedCorpus, folder: Path, pin: dict) -> None:
    """Write the corpus's blocks (uint16, compressed), its tokenizer and its pin into `folder`."""
    if len(corpus.tokenizer) > 65536:
        raise ValueError(f"a vocabulary of {len(corpus.tokenizer)} does not fit uint16: the export holds up to 65,536.")
    folder.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(folder / BLOCKS_FILE, train=corpus.train.numpy().astype(np.uint16),
                        validation=corpus.validation.numpy().astype(np.uint16))  # fmt: skip
    corpus.tokenizer.save_pretrained(folder)
    (folder / PIN_FILE).write_text(json.dumps(pin, indent=2) + "\n")


def load_exported(folder: Path) -> tuple[TokenizedCorpus, dict]:
    """The corpus and its pin from an `export_corpus` folder; refused if the blocks do not match the pin."""
    pin = json.loads((folder / PIN_FILE).read_text())
    with np.load(folder / BLOCKS_FILE) as blocks:
        train = torch.from_numpy(blocks["train"].astype(np.int64))
        validation = torch.from_numpy(blocks["validation"].astype(np.int64))
    corpus = TokenizedCorpus(
        train, validation, tf.PreTrainedTokenizerFast.from_pretrained(folder), tuple(pin["sources"])
    )
    if blocks_digest(corpus) != pin["blocks_sha256"]:
        raise SystemExit(f"{folder}: its blocks do not match its pin's SHA-256: a damaged or edited export.")
    return corpus, pin


def export_ladder(
    documents: Callable[[], list[str]], corpus: TokenizedCorpus, folder: Path, pin: dict, vocab_size: int
) -> None:
    """Write the sources' documents into `folder` once (`LADDER_TEXT`; `documents` is called only where the file is
    missing) and this corpus's tokenizer and pin under ``vocab<vocab_size>/`` (the size asked for, which `load_ladder`
    is given: a trained tokenizer may hold a few tokens fewer); then read it back as the device will (`load_ladder`),
    so that a text file of another build is refused here rather than there."""
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / LADDER_TEXT).exists():
        with written_whole(folder / LADDER_TEXT) as partial, lzma.open(partial, "wt", encoding="utf-8") as handle:
            json.dump(documents(), handle)
    vocabulary = folder / f"vocab{vocab_size}"
    corpus.tokenizer.save_pretrained(vocabulary)
    (vocabulary / PIN_FILE).write_text(json.dumps(pin, indent=2) + "\n")
    load_ladder(folder, vocab_size)


def load_ladder(folder: Path, vocab_size: int) -> tuple[TokenizedCorpus, dict]:
    """The corpus of `vocab_size` and its pin from an `export_ladder` folder: the documents cut with its tokenizer;
    refused if the blocks do not match the pin."""
    vocabulary = folder / f"vocab{vocab_size}"
    if not (vocabulary / PIN_FILE).exists():
        raise SystemExit(f"{folder} holds no {vocab_size}-token vocabulary: export it there first (--export_corpus).")
    pin = json.loads((vocabulary / PIN_FILE).read_text())
    with lzma.open(folder / LADDER_TEXT, "rt", encoding="utf-8") as handle:
        documents = json.load(handle)
    tokenizer = tf.PreTrainedTokenizerFast.from_pretrained(vocabulary)
    corpus = cut_corpus(documents, tokenizer, tuple(pin["sources"]))
    if blocks_digest(corpus) != pin["blocks_sha256"]:
        raise SystemExit(f"{vocabulary}: the blocks cut from its text do not match its pin's SHA-256.")
    return corpus, pin
