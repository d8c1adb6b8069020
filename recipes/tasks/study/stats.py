"""The study's statistics: paired 95% t-intervals, the tokens an arm needs to reach a loss, and which records may be
pooled (same corpus blocks, same CPU kind and kernel path, same device and torch)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from typing import TYPE_CHECKING, TypeVar

from untie_recipes.tasks.study.provenance import POOL_FIELDS
from untie_recipes.tasks.study.training import StudyRecord

if TYPE_CHECKING:
    from untie_recipes.tasks.study.finetune import FineTuneRecord

#: A run's record: a pretraining run's or a fine-tuning run's (both say where they ran and on which corpus).
Record = TypeVar("Record", "StudyRecord", "FineTuneRecord")

#: Two-sided 95% quantiles of Student's t (0.975), by degrees of freedom (scipy.stats.t.ppf(0.975, df), 3 decimals).
T_975 = {
    1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
    11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093, 20: 2.086,
}  # fmt: skip


def t_interval(differences: list[float]) -> dict:
    """Mean, sd, n and the 95% t-interval (t with n - 1 degrees of freedom) of paired differences; the interval is
    None with fewer than 2 values, or where a value is not finite (a diverged run; the mean is then NaN)."""
    n = len(differences)
    if n == 0:
        return {"mean": None, "sd": None, "n": 0, "low": None, "high": None}
    if not all(math.isfinite(d) for d in differences):  # a diverged run: no mean or interval to read
        return {"mean": math.nan, "sd": None, "n": n, "low": None, "high": None}
    mean = statistics.fmean(differences)
    if n < 2:
        return {"mean": mean, "sd": None, "n": 1, "low": None, "high": None}
    if n - 1 not in T_975:
        raise ValueError(f"t_interval: {n} values; the t table covers 2 to {max(T_975) + 1}.")
    sd = statistics.stdev(differences)
    half = T_975[n - 1] * sd / math.sqrt(n)
    return {"mean": mean, "sd": sd, "n": n, "low": mean - half, "high": mean + half}


def below_zero(interval: dict) -> bool:
    """The interval lies entirely below 0 (the arm's loss is lower, at 95%)."""
    return interval.get("high") is not None and interval["high"] < 0


def above_zero(interval: dict) -> bool:
    return interval.get("low") is not None and interval["low"] > 0


def tokens_to_reach(steps: list[int], losses: list[float], target: float, tokens_per_step: int) -> float | None:
    """The tokens a curve needs to reach `target`: at its first point at or below it, linearly interpolated from the
    point before (the first point is reached from step 0 as it is, nothing is read before it); None if never."""
    for index, (step, loss) in enumerate(zip(steps, losses, strict=True)):
        if loss <= target:
            if index == 0:
                return float(step * tokens_per_step)
            before, previous = steps[index - 1], losses[index - 1]
            at = before + (step - before) * (previous - target) / (previous - loss)
            return at * tokens_per_step
    return None


def pool_key(record: StudyRecord | FineTuneRecord) -> tuple:
    """What must be equal for records to be compared: the corpus blocks' digest and `POOL_FIELDS` of the machine."""
    return (record.corpus_digest, *(record.machine.get(name) for name in POOL_FIELDS[1:]))


def pool_groups(records: Iterable[Record]) -> dict[tuple, list[Record]]:
    """Records split by `pool_key`: each group is compared within itself only."""
    groups: dict[tuple, list[Record]] = {}
    for record in records:
        groups.setdefault(pool_key(record), []).append(record)
    return groups


def check_poolable(records: Iterable[StudyRecord]) -> None:
    """Refuse to compare records of different corpus builds or CPU kinds / kernel paths."""
    keys = {pool_key(r) for r in records}
    if len(keys) > 1:
        named = "; ".join(", ".join(f"{n}={v}" for n, v in zip(POOL_FIELDS, key, strict=True)) for key in sorted(keys))
        raise ValueError(f"records of different corpus builds or machines cannot be pooled: {named}")
