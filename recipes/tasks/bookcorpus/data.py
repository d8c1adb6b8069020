"""The BookCorpus experiment's data: corpora (offline, local files, the hub), tokenizers, twin tokens, collators.

The paper's design (paper.md section 2.2): each of the 100 most common English words gets a *twin*, a new token id
appended after the vocabulary, and every occurrence of the word is replaced by its twin with probability 0.5 on
every read. Word and twin are then semantically and conditionally equivalent: the distributional hypothesis holds.
A *skewed* twin is drawn with probability 0.9 instead: still swappable in the input (semantically equivalent),
but its output probability is nine times the word's in every context, so the two are no longer conditionally
equivalent (the Dec-2023 version of the paper's code; "mixed" below skews every other word).
"""

from __future__ import annotations

import gzip
import os
import random
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset, DatasetDict, IterableDatasetDict, load_dataset
from transformers import AutoTokenizer, DataCollatorForLanguageModeling, PreTrainedTokenizerBase

#: The 100 most common English words (Oxford English Corpus ranking), the paper's hard-coded list.
COMMON_WORDS: tuple[str, ...] = (
    "the", "be", "to", "of", "and", "a", "in", "that", "have", "i", "it", "for", "not", "on", "with", "he", "as",
    "you", "do", "at", "this", "but", "his", "by", "from", "they", "we", "say", "her", "she", "or", "an", "will",
    "my", "one", "all", "would", "there", "their", "what", "so", "up", "out", "if", "about", "who", "get", "which",
    "go", "me", "when", "make", "can", "like", "time", "no", "just", "him", "know", "take", "people", "into",
    "year", "your", "good", "some", "could", "them", "see", "other", "than", "then", "now", "look", "only", "come",
    "its", "over", "think", "also", "back", "after", "use", "two", "how", "our", "work", "first", "well", "way",
    "even", "new", "want", "because", "any", "these", "give", "day", "most", "us",
)  # fmt: skip
#: One sentence per line from 16 Shakespeare plays (public domain; built by scripts/build_offline_corpus.py).
OFFLINE_CORPUS = Path(__file__).with_name("shakespeare.txt.gz")
#: An uncased WordPiece vocabulary (8192 tokens, [PAD] = 0) trained on it by the same script.
OFFLINE_VOCAB = Path(__file__).with_name("shakespeare-vocab.txt")
#: How the hub serves datasets that datasets 5 can no longer build from their loading script.
HUB_PARQUET_REVISIONS = {"bookcorpus/bookcorpus": "refs/convert/parquet", "bookcorpus": "refs/convert/parquet"}
#: The paper's split of BookCorpus's single train split (paper.md section 2.1).
PAPER_SPLITS = {"train": "train[:70%]", "validation": "train[70%:80%]"}
TWIN_VARIANTS = ("dh", "mixed")
SKEWED_PROBABILITY = 0.9
LOCAL_BUILDERS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet",
                  ".csv": "csv", ".gz": "text"}  # fmt: skip


# -- Twins --


@dataclass(frozen=True)
class TwinTable:
    """Word ids, their twin ids (appended after the tokenizer's vocabulary) and each twin's draw probability."""

    words: tuple[str, ...]
    word_ids: tuple[int, ...]
    twin_ids: tuple[int, ...]
    probabilities: tuple[float, ...]

    @property
    def pairs(self) -> list[tuple[int, int]]:
        return list(zip(self.word_ids, self.twin_ids, strict=True))

    def pairs_where(self, skewed: bool) -> list[tuple[int, int]]:
        """The (word, twin) pairs drawn .5/.5 (skewed=False: the DH holds) or skewed (the DH fails)."""
        return [pair for pair, p in zip(self.pairs, self.probabilities, strict=True) if (p != 0.5) == skewed]

    def random_pairs(self, seed: int = 42) -> list[tuple[int, int]]:
        """The paper's far baseline: pairs of two *different* common words, one per word, shuffled with `seed`."""
        shuffled = list(self.word_ids)
        random.Random(seed).shuffle(shuffled)
        return [(shuffled[i], shuffled[(i + 1) % len(shuffled)]) for i in range(len(shuffled))]

    def lookup(self, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense tables over ids < vocab_size: each id's twin (itself if none) and its swap probability (0 if none)."""
        twin = torch.arange(vocab_size)
        probability = torch.zeros(vocab_size)
        twin[list(self.word_ids)] = torch.tensor(self.twin_ids)
        probability[list(self.word_ids)] = torch.tensor(self.probabilities)
        return twin, probability


def build_twins(
    tokenizer: PreTrainedTokenizerBase, variant: str = "dh", words: Sequence[str] = COMMON_WORDS
) -> TwinTable:
    """Give each word that is one token of `tokenizer` a twin id len(tokenizer) + i. variant "dh" draws every twin
    with probability .5 (the paper); "mixed" draws every other one (in frequency order) with SKEWED_PROBABILITY."""
    if variant not in TWIN_VARIANTS:
        raise ValueError(f"Unknown twin variant {variant!r}; choose one of {TWIN_VARIANTS}.")
    vocab = tokenizer.get_vocab()
    kept = [w for w in words if w in vocab]
    missing = [w for w in words if w not in vocab]
    if missing:
        # The paper looked "I" up in bert-base-uncased as is and twinned [UNK]; we lowercase, so "i" resolves.
        warnings.warn(f"{len(missing)} common words are not single tokens and get no twin: {missing}", stacklevel=2)
    if not kept:
        raise ValueError("None of the common words is a token of this tokenizer: is it an English, uncased vocab?")
    base = len(tokenizer)
    probabilities = tuple(SKEWED_PROBABILITY if variant == "mixed" and i % 2 else 0.5 for i in range(len(kept)))
    return TwinTable(
        words=tuple(kept),
        word_ids=tuple(vocab[w] for w in kept),
        twin_ids=tuple(base + i for i in range(len(kept))),
        probabilities=probabilities,
    )


class TwinSwapCollator:
    """Swaps words for their twins (fresh draws on every read), then hands the batch to the LM collator.

    Swapping before masking means the labels hold twins too, and MLM random replacements still come only from the
    tokenizer's own ids, as in the paper. Each process should get its own `seed` (e.g. seed + rank).
    """

    def __init__(self, twins: TwinTable, lm_collator: DataCollatorForLanguageModeling, seed: int) -> None:
        self.twins = twins
        self.lm_collator = lm_collator
        self.generator = torch.Generator().manual_seed(seed)
        self.twin_of, self.swap_probability = twins.lookup(len(lm_collator.tokenizer))

    def swap(self, input_ids: torch.Tensor) -> torch.Tensor:
        draws = torch.rand(input_ids.shape, generator=self.generator)
        return torch.where(draws < self.swap_probability[input_ids], self.twin_of[input_ids], input_ids)

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        ids = [torch.as_tensor(f["input_ids"]) for f in features]
        swapped = self.swap(torch.cat(ids)).split([len(i) for i in ids])
        return self.lm_collator([{"input_ids": s} for s in swapped])


def lm_collator(
    tokenizer: PreTrainedTokenizerBase, objective: str, twins: TwinTable, seed: int, mlm_probability: float = 0.15
) -> TwinSwapCollator:
    """The paper's MLM collator (15% masked, 80/10/10) or a causal-LM one, behind the twin swap."""
    if objective not in ("mlm", "clm"):
        raise ValueError(f"Unknown objective {objective!r}; choose 'mlm' or 'clm'.")
    base = DataCollatorForLanguageModeling(
        tokenizer, mlm=objective == "mlm", mlm_probability=mlm_probability, seed=seed, return_tensors="pt"
    )
    return TwinSwapCollator(twins, base, seed=seed + 1)


# -- Corpora --


def offline_sentences() -> list[str]:
    """The shipped offline corpus, one sentence per entry."""
    with gzip.open(OFFLINE_CORPUS, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f if line.strip()]


def load_corpus(
    dataset: str = "offline",
    *,
    dataset_config: str | None = None,
    data_files: Sequence[str] | None = None,
    streaming: bool = False,
    validation_fraction: float = 0.05,
    validation_size: int = 10_000,
    seed: int = 42,
) -> DatasetDict | IterableDatasetDict:
    """A DatasetDict with "train" and "validation" splits of raw text.

    - "offline": the shipped sentences, split by `validation_fraction`;
    - `data_files` (dataset None or "local"): local text / json / parquet / csv files through `load_dataset`;
    - "bookcorpus/bookcorpus": the hub's parquet export with the paper's 70% / 10% split;
    - any other hub id: its validation split if it has one, else `validation_fraction` of train.
    Streaming corpora hold out their first `validation_size` examples instead of a fraction.
    """
    if dataset == "offline" and not data_files:
        sentences = Dataset.from_dict({"text": offline_sentences()})
        split = sentences.train_test_split(test_size=validation_fraction, seed=seed)
        return DatasetDict(train=split["train"], validation=split["test"])
    if data_files:
        suffixes = {Path(f).suffix for f in data_files}
        builders = {LOCAL_BUILDERS.get(s) for s in suffixes}
        if len(builders) != 1 or None in builders:
            raise ValueError(
                f"Cannot tell how to read {sorted(suffixes)}: pass files of one kind among {sorted(LOCAL_BUILDERS)}."
            )
        for path in data_files:
            if not os.path.exists(path):
                raise FileNotFoundError(f"--data_files: {path} does not exist.")
        raw = load_dataset(builders.pop(), data_files=list(data_files), streaming=streaming)
        return _with_validation(raw, streaming, validation_fraction, validation_size, seed)
    revision = HUB_PARQUET_REVISIONS.get(dataset)
    if revision and not streaming:
        return DatasetDict(
            {
                split: load_dataset(dataset, dataset_config, split=spec, revision=revision)
                for split, spec in PAPER_SPLITS.items()
            }  # fmt: skip
        )
    raw = load_dataset(dataset, dataset_config, revision=revision, streaming=streaming)
    return _with_validation(raw, streaming, validation_fraction, validation_size, seed)


def _with_validation(raw, streaming: bool, fraction: float, size: int, seed: int):
    """Keep a dataset's validation split, or hold one out of train."""
    if "validation" in raw:
        return raw
    if streaming:
        return IterableDatasetDict(train=raw["train"].skip(size), validation=raw["train"].take(size))
    split = raw["train"].train_test_split(test_size=fraction, seed=seed)
    return DatasetDict(train=split["train"], validation=split["test"])


# -- Tokenizer and tokenization --

SPECIAL_TOKENS = {"pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]",
                  "mask_token": "[MASK]"}  # fmt: skip


def train_wordpiece_tokenizer(texts: Iterable[str], vocab_size: int = 8192) -> PreTrainedTokenizerBase:
    """An uncased BERT-style WordPiece tokenizer trained on `texts` (seconds on the offline corpus): the offline
    stand-in for bert-base-uncased. [PAD] is id 0, as in the paper's tables."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = list(SPECIAL_TOKENS.values())
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, **SPECIAL_TOKENS)


def load_tokenizer(
    name: str, texts: Iterable[str] | None = None, vocab_size: int = 8192, cache_dir: str | None = None
) -> PreTrainedTokenizerBase:
    """The tokenizer `name` names:

    - "offline": the shipped uncased WordPiece vocabulary of the offline corpus (no download, no training);
    - "train": a WordPiece tokenizer trained on `texts`. Training is not reproducible bit for bit (tie-breaking
      varies between runs), so it is saved to `cache_dir` and reloaded from there when present: every arm and
      every process of a run must share one vocabulary;
    - anything else: AutoTokenizer.from_pretrained (e.g. bert-base-uncased, the paper's, or a local directory).
    """
    if name == "offline":
        from transformers import BertTokenizer

        tokens = OFFLINE_VOCAB.read_text(encoding="utf-8").splitlines()
        return BertTokenizer(vocab={token: i for i, token in enumerate(tokens)}, do_lower_case=True)
    if name == "train":
        if cache_dir and os.path.exists(os.path.join(cache_dir, "tokenizer.json")):
            return AutoTokenizer.from_pretrained(cache_dir)
        if texts is None:
            raise ValueError("tokenizer='train' needs the texts to train on.")
        tokenizer = train_wordpiece_tokenizer(texts, vocab_size)
        if cache_dir:
            tokenizer.save_pretrained(cache_dir)
        return tokenizer
    tokenizer = AutoTokenizer.from_pretrained(name)
    if tokenizer.pad_token is None:  # GPT-2-style tokenizers: pad with EOS, labels mask the padding anyway
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def tokenize_corpus(
    corpus: DatasetDict | IterableDatasetDict,
    tokenizer: PreTrainedTokenizerBase,
    objective: str,
    max_length: int = 128,
    text_column: str = "text",
    num_proc: int | None = None,
) -> DatasetDict | IterableDatasetDict:
    """MLM: one sentence per example, truncated at max_length (no packing, as in the paper). CLM: the texts
    concatenated and cut into blocks of max_length. Cached by `datasets` for file-backed corpora."""
    if text_column not in (corpus["train"].column_names or [text_column]):
        raise ValueError(f"No column {text_column!r} in the corpus; its columns are {corpus['train'].column_names}.")

    def encode(batch: dict[str, list]) -> dict[str, list]:
        texts = [t for t in batch[text_column] if t and t.strip()]
        if objective == "mlm":
            return {"input_ids": tokenizer(texts, truncation=True, max_length=max_length)["input_ids"]}
        flat = [i for ids in tokenizer(texts, add_special_tokens=False)["input_ids"] for i in ids]
        blocks = len(flat) // max_length
        return {"input_ids": [flat[b * max_length : (b + 1) * max_length] for b in range(blocks)]}

    columns = corpus["train"].column_names
    kwargs: dict[str, Any] = dict(batched=True, remove_columns=columns)
    if isinstance(corpus, DatasetDict):
        kwargs.update(num_proc=num_proc, desc=f"Tokenizing ({objective})")
    return corpus.map(encode, **kwargs)
