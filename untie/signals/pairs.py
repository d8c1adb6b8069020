"""Candidate semantically-equivalent token pairs read from a tokenizer's vocabulary, for `pairs="auto"`.

Two tokens that spell one word differently are swappable in the input (semantically equivalent) but not predicted
alike: a capital starts a sentence, a word-start piece follows a space. They are exactly the pairs where the
distributional hypothesis fails in natural text, so their conditional gap is what tying gets wrong.

* **case variants**: ``the`` / ``The`` (within one word-start form: ``Ġthe`` / ``ĠThe``);
* **word-start variants**: byte-level BPE ``Ġthe`` / ``the`` (GPT-2, RoBERTa, Llama 3, Qwen), SentencePiece
  ``▁the`` / ``the`` (Llama 2, T5, Gemma), WordPiece ``the`` / ``##the`` (BERT).

Vocabularies list frequent pieces first (BPE merges in order, SentencePiece by score, WordPiece by count), so a
pair's rank is that of its rarer member, and the first `limit` pairs are the most frequent ones.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Literal, cast

from untie.errors import UntieTypeError

#: How many pairs `pairs="auto"` measures: the most frequent few hundred.
DEFAULT_LIMIT = 256
#: Word-start markers: byte-level BPE's space byte, SentencePiece's meta space.
_WORD_START = ("Ġ", "▁")
_CONTINUATION = "##"

Family = Literal["byte-level-bpe", "sentencepiece", "wordpiece", "unknown"]
PairKind = Literal["case", "word-start"]


@dataclass(frozen=True)
class TokenPair:
    """Two token ids that spell one word differently, and why they are a pair."""

    ids: tuple[int, int]
    tokens: tuple[str, str]
    kind: PairKind


def tokenizer_family(vocab: dict[str, int]) -> Family:
    """Which convention marks word starts in `vocab` (the most common marker among its tokens)."""
    counts = {
        "byte-level-bpe": sum(t.startswith("Ġ") for t in vocab),
        "sentencepiece": sum(t.startswith("▁") for t in vocab),
        "wordpiece": sum(t.startswith(_CONTINUATION) for t in vocab),
    }
    family, count = max(counts.items(), key=lambda item: item[1])
    return cast(Family, family) if count >= max(10, len(vocab) // 100) else "unknown"


def vocabulary_pairs(
    vocab: dict[str, int],
    *,
    limit: int = DEFAULT_LIMIT,
    exclude: Collection[int] = frozenset(),
    max_id: int | None = None,
) -> list[TokenPair]:
    """The `limit` most frequent case and word-start pairs of `vocab` (token -> id), most frequent first.

    Only alphabetic words of two letters or more count (digits and punctuation have no case, and their word-start
    forms are rare). `exclude` drops ids (special tokens); `max_id` drops ids the model has no row for.
    """
    family = tokenizer_family(vocab)
    marker = {"byte-level-bpe": "Ġ", "sentencepiece": "▁"}.get(family)
    usable = {t: i for t, i in vocab.items() if i not in exclude and (max_id is None or i < max_id)}
    found: dict[tuple[int, int], TokenPair] = {}

    def add(first: str, second: str, kind: PairKind) -> None:
        if first in usable and second in usable and usable[first] != usable[second]:
            ids = (usable[first], usable[second])
            key = (min(ids), max(ids))
            found.setdefault(key, TokenPair(ids, (first, second), kind))

    for token in usable:
        start = marker if marker and token.startswith(marker) else ""
        word = token[len(start) :]
        if family == "wordpiece" and word.startswith(_CONTINUATION):
            continue  # reached from its word-start form below
        if len(word) < 2 or not word.isalpha():
            continue
        if word.islower():
            add(token, start + word.capitalize(), "case")
        if family == "wordpiece":
            add(token, _CONTINUATION + word, "word-start")
        elif marker and start:
            add(token, word, "word-start")
    ranked = sorted(found.values(), key=lambda pair: (max(pair.ids), min(pair.ids)))
    return ranked[:limit]


def is_tokenizer(processing_class) -> bool:
    """Whether `processing_class` is (or holds, as processors do, as `.tokenizer`) a tokenizer with a vocabulary."""
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    return callable(getattr(tokenizer, "get_vocab", None))


def tokenizer_pairs(tokenizer, *, limit: int = DEFAULT_LIMIT, max_id: int | None = None) -> list[TokenPair]:
    """`vocabulary_pairs` of a Hugging Face tokenizer (or a processor holding one as `.tokenizer`)."""
    if not is_tokenizer(tokenizer):
        raise UntieTypeError(
            f"pairs='auto' reads the pairs from a tokenizer, got {type(tokenizer).__name__}. Pass "
            "Trainer(processing_class=tokenizer), or list the pairs yourself: pairs=[(id_a, id_b), ...]."
        )
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
    exclude = set(getattr(tokenizer, "all_special_ids", ()) or ())
    return vocabulary_pairs(tokenizer.get_vocab(), limit=limit, exclude=exclude, max_id=max_id)
