"""The study's default for a model built fresh, by its embedding's share (issue 77's rule, docs/recipes/study.md
"Round two"): each measured cell's choice holds from its share to the midpoint with its neighbour's, the outermost to
0% and 100%. The table below is generated from the study's committed records, never edited by hand:

    python recipes/study.py --report_only --output_dir runs/study-report   # round-two.md holds it
    python scripts/docs_tables.py --write library-share-bands              # writes it here; CI runs --check

Policy "by-share" (`untie.UntieConfig.policy`) reads it; it is the default once `SHARE_DEFAULT.complete` (every
cell of round two has a choice: the amendment of 2026-11-29, the default moves once, on all of them). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass

from untie.errors import UntieValueError

BANDS_TABLE = """
<!-- table: library-share-bands -->
| from | to | choice | untie_at | input embedding's rate | cells | status |
|---|---|---|---|---|---|---|
| 0.000000 | 0.412660 | untied-emb16 | 0 | 16x | C | complete |
| 0.412660 | 0.708344 | untie@2/3 | 0.666667 | 1x | B | complete |
| 0.708344 | 1.000000 | untied | 0 | 1x | A | complete |
<!-- end table: library-share-bands -->
"""


@dataclass(frozen=True)
class ShareBand:
    """One band of embedding shares and what the study's rule chose for it."""

    low: float
    high: float
    arm: str
    """The study's arm ("untied", "untie@2of3", "tied", "untied-emb16"): docs/recipes/study.md names them."""
    untie_at: float | None
    """0: untied from step 0 (head drawn); a fraction in (0, 1): a tied phase to that fraction of the run, no
    trigger; None: stays tied."""
    embedding_lr_scale: float
    """The input embedding's learning-rate scale the arm trains with (1: the user's rate)."""
    cells: tuple[str, ...]

    def covers(self, share: float) -> bool:
        return self.low <= share < self.high or (share == self.high == 1.0)

    def describe(self) -> str:
        """What the band's choice does, in words."""
        if self.untie_at is None:
            plan = "stays tied"
        elif self.untie_at == 0:
            plan = "trains untied from step 0, its head drawn"
        else:
            plan = f"trains tied to {self.untie_at:.3g} of the run, then unties (no trigger)"
        scale = "" if self.embedding_lr_scale == 1 else scale_clause(self.embedding_lr_scale)
        cells = f"cell{'s' * (len(self.cells) > 1)} {', '.join(self.cells)}"
        return (
            f"the study's default by embedding share: from {self.low:.1%} to {self.high:.1%} ({cells}) it {plan}"
            f"{scale} (arm {self.arm}, docs/recipes/when-it-pays.md)"
        )


def scale_clause(scale: float) -> str:
    """What a band that scales the input embedding's rate says of it (`ShareBand.describe`): the run's reason drops it
    where the scale does not apply (`untie.decision.decide`)."""
    return (
        f", the input embedding at {scale:g}x the learning rate (embedding_lr_scale; pass embedding_lr_scale=1 to keep "
        "your rate)"
    )


@dataclass(frozen=True)
class ShareDefault:
    """The bands, and whether round two's rule has read them (`complete`)."""

    bands: tuple[ShareBand, ...]
    status: str

    @property
    def complete(self) -> bool:
        return self.status == "complete" and bool(self.bands)

    def band(self, share: float) -> ShareBand | None:
        """The band holding `share` (in [0, 1]); None where the bands are not complete."""
        if not self.complete:
            return None
        return next((b for b in self.bands if b.covers(share)), None)


def _number(text: str) -> float | None:
    return None if text.strip() in ("none", "") else float(text)


def parse_bands(table: str) -> ShareDefault:
    """The `ShareDefault` a generated table (`BANDS_TABLE`) holds; a malformed one is refused by what is wrong."""
    rows = [line for line in table.splitlines() if line.startswith("|")][2:]
    bands, statuses = [], set()
    for row in rows:
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) != 7:
            raise UntieValueError(f"share bands: a row has {len(cells)} columns, not 7: {row!r}")
        low, high, arm, untie_at, scale, names, status = cells
        bands.append(
            ShareBand(float(low), float(high), arm, _number(untie_at), float(scale.rstrip("x")),
                      tuple(n.strip() for n in names.split(",")))
        )  # fmt: skip
        statuses.add(status)
    if len(statuses) > 1:
        raise UntieValueError(f"share bands: the rows disagree on the status: {sorted(statuses)}")
    edges = [(b.low, b.high) for b in bands]
    gaps = any(a[1] != b[0] for a, b in zip(edges, edges[1:], strict=False))
    if bands and (edges[0][0] != 0.0 or edges[-1][1] != 1.0 or gaps):
        raise UntieValueError(f"share bands: the bands do not cover 0 to 1 without gaps: {edges}")
    return ShareDefault(tuple(bands), statuses.pop() if statuses else "pending: no cell has a choice yet")


#: The bands in force (`BANDS_TABLE`).
SHARE_DEFAULT = parse_bands(BANDS_TABLE)
