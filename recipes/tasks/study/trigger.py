"""The trigger, measured without acting: the tied run reads the default trigger's signal at the default cadence and
records, per measurement, the signal and whether the trigger would have fired, but never unties.

It is the measurement `untie.Untier` makes (`untie.core.run.UntieRun.measure`), from the library's own pieces: the
tokenizer's pairs (`read_pairs`, what ``pairs=None`` with a tokenizer reads), the role-gradient probe armed on every
`metrics_every`-th step and read just before the optimizer steps (after clipping, as in a custom loop), the role
signals, and the default rule's `DivergenceTrigger` (the evidence rule with pairs, the pair-free one without). Only
the untie is left out, so the tied run's numbers are those of a tied run that measures nothing
(`tests/test_study.py` checks it)."""

from __future__ import annotations

import math

import torch

from untie import UntieConfig
from untie.decision.triggers import DivergenceTrigger, resolve_step
from untie.signals.metrics import role_signals_on_rows
from untie.signals.probe import RoleGradientProbe
from untie.structure.facts import read_pairs


class TriggerWatch:
    """Measures the default trigger (`UntieConfig()`: its rule, `metrics_every`, its deadline) on a tied run of
    `budget` steps that starts after step `start`. Call `arm(step)` before optimizer step `step`'s forward; the
    measurement happens in an optimizer step pre-hook."""

    def __init__(self, model, optimizer, tokenizer, budget: int, start: int = 0, config: UntieConfig | None = None):
        config = config or UntieConfig()
        self.pairs, _why = read_pairs(tokenizer, model, asked=False, owner="study", hint="the corpus's tokenizer")
        rule = config.rule(with_pairs=bool(self.pairs))
        assert rule is not None, "the default config has a trigger"
        self.trigger = DivergenceTrigger(rule)
        self.trigger.resolve(budget)
        self.every = config.metrics_every
        self.deadline = resolve_step(config.untie_at, budget, "untie_at")
        self.probe = RoleGradientProbe(model, pairs=self.pairs)
        self.handle = optimizer.register_step_pre_hook(lambda *_: self._measure())
        self.measurements: list[dict] = []
        self.pending: int | None = None
        self.arm(start + 1)

    def arm(self, step: int) -> None:
        """Optimizer step `step` runs next: measure it if it is a measurement step of the cadence."""
        measures = self.every > 0 and step % self.every == 0
        self.probe.armed = measures
        self.pending = step if measures else None

    def _measure(self) -> None:
        step, self.pending = self.pending, None
        if step is None:
            return
        self.probe.armed = False
        grads = self.probe.collect()
        signals: dict[str, float] = {}
        if grads is not None:
            signals = role_signals_on_rows(grads, pairs=self.pairs)
            signals.update(self.probe.pair_measurements(grads))
        fired = self.trigger.update(step, signals)
        average = self.trigger.average
        self.measurements.append({
            "step": step, "signal": _finite(self.trigger.value_of(signals)),
            "average": _finite(average), "streak": self.trigger.streak,
            "learned_z": _finite(signals.get("learned_z", math.nan)), "would_fire": bool(fired),
        })  # fmt: skip

    @property
    def first_would_fire(self) -> int | None:
        return self.trigger.fired_step

    def summary(self) -> dict:
        """What the run's record keeps: the rule, the cadence, the deadline, every measurement, the first would-fire
        step, and the step the default would have untied a loaded tied model at (the first of the two)."""
        fired = self.first_would_fire
        candidates = [s for s in (fired, self.deadline) if s is not None]
        return {
            "rule": self.trigger.rule.to_dict(), "metrics_every": self.every, "pairs": len(self.pairs),
            "deadline_step": self.deadline, "first_would_fire_step": fired,
            "default_untie_step": min(candidates) if candidates else None, "measurements": list(self.measurements),
        }  # fmt: skip

    def state_dict(self) -> dict:
        """What a resume checkpoint keeps: the trigger's running state, the measurements, which pair symbols the probe
        has seen (a pair is read once both its symbols have occurred)."""
        return {"trigger": self.trigger.state_dict(), "measurements": list(self.measurements),
                "seen": self.probe._seen.clone()}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        self.trigger.load_state_dict(state["trigger"])
        self.measurements = list(state["measurements"])
        self.probe._seen = torch.as_tensor(state["seen"]).clone()

    def remove(self) -> None:
        self.handle.remove()
        self.probe.remove()


def _finite(value: float | None) -> float | None:
    """JSON has no NaN: an unmeasured value is None."""
    return value if value is not None and math.isfinite(value) else None
