"""The EXor task of Bertolotti & Cazzola (ICML 2024), built as the paper's code builds it.

Bit strings of length ``N`` carry their parity as a last symbol. Every bit is written with one of two surface
symbols drawn afresh on every read, one bit per sequence is masked, and the model must name the masked surface
symbol. Two forms of the same bit are semantically equivalent by construction; they are conditionally
equivalent only when their draw weights are equal, which is what the three variants play with.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

#: Draw weights (zero forms, one forms) of the paper's three data variants.
VARIANTS: dict[str, tuple[tuple[float, float], tuple[float, float]]] = {
    "main": ((0.1, 0.9), (0.5, 0.5)),  # (0,1) semantic only; (2,3) semantic and conditional
    "ydh": ((1.0, 0.0), (0.5, 0.5)),  # the distributional hypothesis holds: symbol 1 never occurs
    "ndh": ((1.0, 0.0), (0.1, 0.9)),  # it fails: (2,3) is semantic only
}
#: The two forms of each bit: semantically equivalent by construction, in every variant (a form that never occurs,
#: symbol 1 in ydh and ndh, gives its pair no evidence, and `untie` skips the pair).
EQUIVALENT_PAIRS: tuple[tuple[int, int], ...] = ((0, 1), (2, 3))
#: Symbol pairs the paper plots, plus a reference pair of different bits (weight decay shrinks all distances).
PAIRS: tuple[tuple[int, int], ...] = (*EQUIVALENT_PAIRS, (0, 2))
SPLIT_SEED = 14  # the paper's dataset seed; no makefile changes it, so the split is fixed
IGNORE_INDEX = -100


@dataclass(frozen=True)
class ExorVocabulary:
    """Symbol ids for one variant: bit forms first, then even, odd and [MASK]."""

    zero_weights: tuple[float, ...]
    one_weights: tuple[float, ...]

    @property
    def zero_forms(self) -> range:
        return range(len(self.zero_weights))

    @property
    def one_forms(self) -> range:
        return range(len(self.zero_weights), len(self.zero_weights) + len(self.one_weights))

    @property
    def even(self) -> int:
        return len(self.zero_weights) + len(self.one_weights)

    @property
    def odd(self) -> int:
        return self.even + 1

    @property
    def mask(self) -> int:
        return self.even + 2

    @property
    def size(self) -> int:
        return self.mask + 1

    def bayes_accuracy(self, zero_fraction: float = 0.5) -> float:
        """Best possible masked-symbol accuracy: the parity gives the bit, the likelier form is the guess."""
        return zero_fraction * max(self.zero_weights) + (1 - zero_fraction) * max(self.one_weights)


def vocabulary(variant: str) -> ExorVocabulary:
    if variant not in VARIANTS:
        raise ValueError(f"Unknown EXor variant {variant!r}; choose one of {sorted(VARIANTS)}.")
    zero, one = VARIANTS[variant]
    return ExorVocabulary(zero, one)


def exor_splits(n_bits: int = 7, split_seed: int = SPLIT_SEED) -> dict[str, list[tuple[int, ...]]]:
    """The paper's fixed split: integers 0 .. 2**N - 2 (its off-by-one drops the all-ones string), shuffled
    once with ``random.Random(14)``; train is the first 90%, then 12 held-out strings ("validation"), then 1 test."""
    strings = [tuple(int(b) for b in format(i, f"0{n_bits}b")) for i in range(2**n_bits - 1)]
    random.Random(split_seed).shuffle(strings)
    n_train = int(0.9 * len(strings))
    n_heldout = int(0.1 * len(strings))
    return {
        "train": strings[:n_train],
        "heldout": strings[n_train : n_train + n_heldout],
        "test": strings[n_train + n_heldout :],
    }


class ExorDataset(torch.utils.data.Dataset):
    """Masked EXor sequences: ``input_ids`` and ``labels`` of length N + 1 (bits, then the parity symbol).

    Surface forms and the masked position are redrawn on every read, as in the paper, from a generator seeded
    with ``seed``: with ``dataloader_num_workers=0`` a run is reproducible from its seed. ``repeats`` > 1 lists
    every string that many times, which gives evaluation sets with less sampling noise. Batched reads
    (``__getitems__``, which DataLoader uses) draw a whole batch at once.
    """

    def __init__(
        self,
        split: str = "train",
        variant: str = "main",
        *,
        n_bits: int = 7,
        seed: int = 0,
        repeats: int = 1,
    ) -> None:
        splits = exor_splits(n_bits)
        if split not in splits:
            raise ValueError(f"Unknown EXor split {split!r}; choose one of {sorted(splits)}.")
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}.")
        self.vocab = vocabulary(variant)
        self.variant = variant
        self.split = split
        self.bits = torch.tensor(splits[split], dtype=torch.long)
        self.repeats = repeats
        self.generator = torch.Generator().manual_seed(seed)
        # Per bit value: the first form's id and the cumulative draw weights that pick among its forms.
        self._first_form = torch.tensor([self.vocab.zero_forms.start, self.vocab.one_forms.start])
        self._zero_edges = torch.tensor(self.vocab.zero_weights, dtype=torch.float64).cumsum(0)[:-1]
        self._one_edges = torch.tensor(self.vocab.one_weights, dtype=torch.float64).cumsum(0)[:-1]

    def __len__(self) -> int:
        return len(self.bits) * self.repeats

    def draw(self, indices: list[int]) -> dict[str, torch.Tensor]:
        """One fresh batch for the given indices: surface forms, parity symbol, one masked bit per row."""
        bits = self.bits[torch.as_tensor(indices, dtype=torch.long) % len(self.bits)]
        u = torch.rand(bits.shape, generator=self.generator, dtype=torch.float64)
        offset = torch.where(
            bits.bool(),
            (u.unsqueeze(-1) >= self._one_edges).sum(-1),
            (u.unsqueeze(-1) >= self._zero_edges).sum(-1),
        )
        forms = self._first_form[bits] + offset
        parity = torch.where(bits.sum(-1) % 2 == 1, self.vocab.odd, self.vocab.even)
        input_ids = torch.cat([forms, parity.unsqueeze(-1)], dim=-1)
        masked = torch.randint(bits.shape[-1], (len(bits),), generator=self.generator)
        rows = torch.arange(len(bits))
        labels = torch.full_like(input_ids, IGNORE_INDEX)
        labels[rows, masked] = input_ids[rows, masked]
        input_ids[rows, masked] = self.vocab.mask
        return {"input_ids": input_ids, "labels": labels}

    def __getitems__(self, indices: list[int]) -> list[dict[str, torch.Tensor]]:
        batch = self.draw(indices)
        rows = zip(batch["input_ids"], batch["labels"], strict=True)
        return [{"input_ids": ids, "labels": labels} for ids, labels in rows]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.__getitems__([index])[0]
