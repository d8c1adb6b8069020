"""Trigger policies: decide at which optimizer step the embeddings are untied.

`ScheduledTrigger` fires at a fixed step. `DivergenceTrigger` fires when a smoothed role signal (see
`untie.signals.metrics.role_signals_on_rows`) has stayed past a threshold for a number of consecutive measurements;
under the evidence rule (`RULES["evidence"]`, the default with pairs), only once the model has learned and the data have
given significant evidence that a pair's two symbols are predicted apart.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from untie.decision.metric_keys import metric_key, split_metric_key
from untie.errors import UntieValueError


@dataclass
class ScheduledTrigger:
    """Fires once the global step reaches `untie_at` (an int step, or a fraction of the run's `max_steps`)."""

    untie_at: int | float | None
    step: int | None = None
    """The resolved step; set by `resolve` when the run length is known."""

    def resolve(self, max_steps: int | None) -> int | None:
        """Turn `untie_at` into a global step for a run of `max_steps` optimizer steps; raise if it lies beyond."""
        self.step = resolve_step(self.untie_at, max_steps, "untie_at")
        return self.step

    def fires(self, global_step: int) -> bool:
        return self.step is not None and global_step >= self.step


def resolve_step(at: int | float | None, max_steps: int | None, name: str) -> int | None:
    """An int step stays as is, a float in (0, 1) is a fraction of `max_steps`; an int beyond the run is refused.
    `max_steps` None: a run of unknown length (a custom loop), where only int steps can be resolved."""
    if at is None:
        return None
    if isinstance(at, float):
        if max_steps is None:
            raise UntieValueError(f"{name}={at} is a fraction of the run, whose length is unknown: pass max_steps.")
        return max(1, round(at * max_steps))
    if max_steps is not None and max_steps > 0 and at > max_steps:
        raise UntieValueError(
            f"{name}={at} is beyond the end of the run (max_steps={max_steps}). Pass a step <= max_steps, a fraction "
            "in (0, 1) such as 0.3, or None."
        )
    return at


#: Signals `UntieWhen.signal` accepts, and the direction in which each one means "the roles disagree".
SIGNAL_DIRECTIONS = {
    "cancellation": "above",
    "cosine": "below",
    "conflict": "above",
    "norm_ratio": "above",
    "agreement": "below",
}
#: Per-pair signals (need `UntieConfig.pairs`): ``<name>/<a>-<b>`` for one pair, ``<name>`` for the largest over pairs.
PAIR_SIGNALS = ("tension", "gap")


def pair_signal(signal: str) -> tuple[str, str] | None:
    """("tension", "0-1") for ``tension/0-1``, ("gap", "") for ``gap``; None for a signal that is not per pair."""
    name, pair = split_metric_key(signal)
    return (name, pair) if name in PAIR_SIGNALS else None


def _pair_part(signal: str) -> str:
    """The pair of a per-pair signal ("0-1" of ``gap/0-1``, "" of ``gap``)."""
    parsed = pair_signal(signal)
    assert parsed is not None, f"{signal!r} is not a per-pair signal"
    return parsed[1]


@dataclass
class UntieWhen:
    """When the divergence trigger unties: the rule, as a JSON-friendly dataclass.

    signal: a role signal of `untie.signals.metrics.role_signals_on_rows` (``cancellation``, ``cosine``, ``conflict``,
        ``norm_ratio``, ``agreement``) or a per-pair one (needs `UntieConfig.pairs`): ``tension/0-1``, or
        ``gap/0-1``, the pair's conditional gap (`untie.signals.metrics.pair_gap_sums_from_log_probs`); ``tension`` or
        ``gap`` alone means the largest over the pairs that were measured.
    threshold: the trigger fires when the smoothed signal is past it: above it, or below it for ``cosine``.
    smoothing: weight of the past in the exponential moving average of the signal, in [0, 1); 0 = raw values.
    warmup: measurements before this step (int) or fraction of `max_steps` (float) only feed the average.
    patience: consecutive measurements past the threshold needed to fire.
    significance: with a ``gap`` signal, turns on the evidence rule at this false-alarm level alpha (e.g. 0.01); None
        (default) reads the gap alone. Under the evidence rule a measurement counts only once the model has
        learned (its cross-entropy lies `LEARNED_Z` standard errors below log(vocab), the best an uninformed
        prediction can do: `untie.signals.metrics.learned_z`), and a pair counts only when its gap is past the threshold
        and the evidence against its conditional equivalence summed since then
        (`untie.signals.metrics.pair_evidence_sums`)
        exceeds log(pairs / alpha): at most alpha is the chance that a pair whose two symbols are conditionally
        equivalent ever passes (Ville's inequality, with a Bonferroni share per pair).
    """

    signal: str = "cancellation"
    threshold: float = 0.5
    smoothing: float = 0.9
    warmup: int | float = 0.05
    patience: int = 5
    significance: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.signal, str):
            raise UntieValueError(
                f"untie_when.signal={self.signal!r}: pass a signal's name, e.g. 'gap' or 'cancellation'."
            )
        for name in ("threshold", "smoothing", "warmup", "significance"):
            value = getattr(self, name)
            if name == "significance" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise UntieValueError(f"untie_when.{name}={value!r}: pass a number (see help(untie.UntieWhen)).")
        if self.signal not in SIGNAL_DIRECTIONS and pair_signal(self.signal) is None:
            raise UntieValueError(
                f"untie_when.signal={self.signal!r} is not a known signal: use one of {sorted(SIGNAL_DIRECTIONS)}, "
                "or, with pairs=..., 'gap', 'gap/<a>-<b>', 'tension' or 'tension/<a>-<b>'."
            )
        if not math.isfinite(self.threshold):
            raise UntieValueError(f"untie_when.threshold={self.threshold} must be a finite number.")
        if not 0.0 <= self.smoothing < 1.0:
            raise UntieValueError(f"untie_when.smoothing={self.smoothing} must be in [0, 1): the weight of the past.")
        if isinstance(self.warmup, bool) or self.warmup < 0 or (isinstance(self.warmup, float) and self.warmup >= 1):
            raise UntieValueError(f"untie_when.warmup={self.warmup}: pass a step >= 0 or a fraction in [0, 1).")
        if isinstance(self.patience, bool) or not isinstance(self.patience, int) or self.patience < 1:
            raise UntieValueError(f"untie_when.patience={self.patience} must be an int >= 1.")
        if self.significance is not None:
            if not 0.0 < self.significance < 1.0:
                raise UntieValueError(
                    f"untie_when.significance={self.significance} must be in (0, 1), e.g. 0.01, or None."
                )
            if (pair_signal(self.signal) or ("", ""))[0] != "gap":
                raise UntieValueError(
                    "untie_when.significance weighs the evidence against a pair's conditional equivalence, so it "
                    f"needs signal='gap' (or 'gap/<a>-<b>'), got {self.signal!r}; or pass significance=None."
                )

    @property
    def reads_pairs(self) -> bool:
        """Its signal is a per-pair one (`pair_signal`): it needs measured pairs."""
        return pair_signal(self.signal) is not None

    @property
    def direction(self) -> str:
        return SIGNAL_DIRECTIONS.get(self.signal, "above")

    @classmethod
    def coerce(cls, value: UntieWhen | dict | str | None, with_pairs: bool = False) -> UntieWhen | None:
        """Accept an `UntieWhen`, its dict form, the name of a rule in `RULES`, ``"divergence"`` (`default_rule`,
        which depends on whether pairs are measured) or None (no trigger)."""
        if value is None or isinstance(value, cls):
            return value
        if value == "divergence":
            return default_rule(with_pairs)
        if isinstance(value, str) and value in RULES:
            return replace(RULES[value])
        if isinstance(value, dict):
            known = {f.name for f in fields(cls)}
            unknown = sorted(set(value) - known)
            if unknown:
                raise UntieValueError(f"Unknown untie_when keys {unknown}; known keys: {sorted(known)}.")
            return cls(**value)
        raise UntieValueError(
            f"untie_when={value!r}: pass 'divergence' (the default rule), a rule name from {sorted(RULES)}, an "
            "untie.UntieWhen(...), its dict form, or None for no trigger."
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


#: Cross-entropy this many standard errors below log(vocab) marks a model that has learned (the evidence rule's
#: warm-up; `untie.signals.metrics.learned_z`): a one-sided test at about 0.1%.
LEARNED_Z = 3.0

#: Named rules, for ``untie_when="<name>"``.
RULES: dict[str, UntieWhen] = {
    # The paper's criterion on evidence: a pair known to be semantically equivalent is predicted more than 1 nat
    # apart (a probability ratio of e), the data back that difference at alpha = 1%, after the model has learned.
    "evidence": UntieWhen(signal="gap", threshold=1.0, smoothing=0.0, warmup=0, patience=3, significance=0.01),
    # The gap alone, smoothed, after a warm-up of 5% of the run (the default with pairs before the evidence rule).
    "gap": UntieWhen(signal="gap", threshold=1.0, smoothing=0.9, warmup=0.05, patience=5),
    # Pair-free: more than half of the two roles' updates cancel (the defaults of UntieWhen).
    "cancellation": UntieWhen(),
}


def default_rule(with_pairs: bool) -> UntieWhen:
    """The rule ``"divergence"`` (and the default `UntieConfig`) stands for: with pairs, the evidence rule
    (`RULES["evidence"]`); without, the pair-free rule (`RULES["cancellation"]`: more than half of the two roles'
    updates cancel)."""
    return replace(RULES["evidence" if with_pairs else "cancellation"])


class DivergenceTrigger:
    """Fires when an exponential moving average of a role signal stays past a threshold for `patience` measurements.

    Under the evidence rule (``rule.significance`` set) it waits for the model to learn and reads each pair's
    accumulated evidence too (see `UntieWhen`). Deterministic: the same sequence of measurements gives the same
    decision. Non-finite values (NaN, inf) are skipped and break the streak, so a diverging or broken measurement
    never unties.
    """

    def __init__(self, rule: UntieWhen) -> None:
        self.rule = rule
        self.warmup_step = 0
        self.average: float | None = None
        self.streak = 0
        self.fired_step: int | None = None
        self.learned_step: int | None = None
        """Evidence rule: the first measurement at which the model had learned (its warm-up ended)."""
        self.evidence: dict[str, float] = {}
        """Evidence rule: each pair's evidence against its conditional equivalence, summed since `learned_step`."""
        self.fired_pairs: list[str] = []
        """The pairs that were past the rule when it fired (largest gap first)."""

    def resolve(self, max_steps: int | None) -> None:
        warmup = self.rule.warmup
        if isinstance(warmup, float) and max_steps is None:
            raise UntieValueError(
                f"UntieWhen(warmup={warmup}) is a fraction of the run, whose length is unknown: pass max_steps, or "
                "an int warmup (steps)."
            )
        if isinstance(warmup, float):
            assert max_steps is not None  # refused above
            self.warmup_step = max(0, round(warmup * max_steps))
        else:
            self.warmup_step = warmup

    def chances(self, metrics_every: int, last_step: int) -> int:
        """How many measurements, taken every `metrics_every` steps, fall after the warm-up and by `last_step`."""
        return measurement_chances(self.warmup_step, metrics_every, last_step)

    def value_of(self, signals: dict[str, float]) -> float:
        """The rule's signal from a dict of measurements (``tension``, ``gap``: the largest finite pair value)."""
        if self.rule.signal in PAIR_SIGNALS:
            values = [v for k, v in signals.items() if k.startswith(self.rule.signal + "/") and math.isfinite(v)]
            return max(values) if values else math.nan
        return signals.get(self.rule.signal, math.nan)

    def update(self, step: int, signals: dict[str, float]) -> bool:
        """Feed the measurements taken at `step`; True once the trigger has fired (it stays fired)."""
        if self.fired_step is not None:
            return True
        if self.rule.significance is not None:
            return self._update_on_evidence(step, signals)
        value = self.value_of(signals)
        if not math.isfinite(value):
            self.streak = 0
            return False
        beta = self.rule.smoothing
        self.average = value if self.average is None else beta * self.average + (1 - beta) * value
        past = (
            self.average > self.rule.threshold if self.rule.direction == "above" else self.average < self.rule.threshold
        )
        self.streak = self.streak + 1 if past and step >= self.warmup_step else 0
        if self.streak >= self.rule.patience:
            self.fired_step = step
        return self.fired_step is not None

    def evidence_needed(self, pairs: int) -> float:
        """Evidence rule: the nats a pair's summed evidence must reach, log(pairs / alpha)."""
        assert self.rule.significance is not None, "the evidence rule has a significance"
        return math.log(max(pairs, 1) / self.rule.significance)

    def _update_on_evidence(self, step: int, signals: dict[str, float]) -> bool:
        learned = signals.get("learned_z", math.nan)
        if self.learned_step is None:
            if not (learned >= LEARNED_Z and step >= self.warmup_step):
                self.streak = 0
                return False
            self.learned_step = step
        wanted = _pair_part(self.rule.signal)
        gaps = {
            pair: value
            for key, value in signals.items()
            for name, pair in [split_metric_key(key)]
            if name == "gap" and pair and (not wanted or pair == wanted)
        }
        past = []
        for pair, gap in gaps.items():
            evidence = signals.get(metric_key("evidence", pair), math.nan)
            if not (math.isfinite(gap) and math.isfinite(evidence)):
                continue
            self.evidence[pair] = self.evidence.get(pair, 0.0) + evidence
            if gap > self.rule.threshold and self.evidence[pair] >= self.evidence_needed(len(gaps)):
                past.append((gap, pair))
        finite = [gap for gap in gaps.values() if math.isfinite(gap)]
        self.average = max(finite) if finite else None
        self.streak = self.streak + 1 if past else 0
        if self.streak >= self.rule.patience:
            self.fired_step = step
            self.fired_pairs = [pair for _, pair in sorted(past, reverse=True)]
        return self.fired_step is not None

    def state_dict(self) -> dict[str, Any]:
        return {
            "average": self.average,
            "streak": self.streak,
            "fired_step": self.fired_step,
            "learned_step": self.learned_step,
            "evidence": dict(self.evidence),
            "fired_pairs": list(self.fired_pairs),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.average = state.get("average")
        self.streak = state.get("streak", 0)
        self.fired_step = state.get("fired_step")
        self.learned_step = state.get("learned_step")
        self.evidence = dict(state.get("evidence", {}))
        self.fired_pairs = list(state.get("fired_pairs", []))


def measurement_chances(warmup_step: int, metrics_every: int, last_step: int) -> int:
    """How many measurements, taken every `metrics_every` steps, fall after a warm-up of `warmup_step` steps and by
    `last_step`."""
    if metrics_every <= 0:
        return 0
    first = max(warmup_step, 1)
    return max(0, last_step // metrics_every - (first - 1) // metrics_every)


def rule_name(rule: UntieWhen) -> str:
    """The trigger's rule in words: its name in `RULES` ("evidence", not its signal "gap", which the gap rule reads
    too), else its signal and threshold, with its evidence level where it has one."""
    named = next((name for name, known in RULES.items() if known == rule), None)
    if named is not None:
        return named
    evidence = f", evidence at alpha={rule.significance:g}" if rule.significance is not None else ""
    return f"{rule.signal} past {rule.threshold:g}{evidence}"
