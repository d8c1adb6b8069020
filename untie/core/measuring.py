"""What a run measures: the role signals of each `metrics_every`-th step's gradients, fed to the divergence trigger,
and the drift between the two spaces once untied (`drift`), kept as the run's history (`Measurements`); the pairs it
measures are read with the model's other facts (`untie.structure.facts.pairs_for`). The run
(`untie.core.run.UntieRun`) says when; this module measures and keeps."""

from __future__ import annotations

import logging
import math

from torch import nn

from untie import _compat
from untie.decision.triggers import DivergenceTrigger
from untie.distributed import full_shape, gather_rows, gathered, is_sharded
from untie.registry import Registry
from untie.signals.metrics import drift_metrics, role_signals_on_rows, sampled_drift_metrics, summarize_pair_metrics
from untie.signals.probe import RoleGradientProbe
from untie.structure.surgery import input_weight, output_weight

logger = logging.getLogger(__name__)

#: Sample sizes of the drift metrics measured during training: about 0.1 s on CPU for GPT-2 small.
DRIFT_SAMPLE = {"queries": 256, "pool": 4096, "rows": 2048}


def drift(model: nn.Module, pairs: list[tuple[int, int]], step: int) -> dict[str, float]:
    """The drift metrics between the untied model's embedding and head (`untie.signals.metrics.drift_metrics`) on
    `DRIFT_SAMPLE`, seeded by `step`. Every rank must call it: ZeRO-3 gathers both matrices, FSDP2 reads only the
    sampled rows of each rank's shard (every rank samples the same rows)."""
    embedding = input_weight(model)
    head = output_weight(model)
    if not is_sharded(embedding):
        with gathered(embedding, head):
            return drift_metrics(embedding, head, pairs=pairs, seed=step, **DRIFT_SAMPLE)
    return sampled_drift_metrics(
        lambda ids: (gather_rows(embedding, ids), gather_rows(head, ids)),
        vocab=full_shape(embedding)[0],
        pairs=pairs,
        seed=step,
        **DRIFT_SAMPLE,
    )


class Measurements:
    """A run's measurements: the role-gradient probe of the tied phase (`untie.signals.probe.RoleGradientProbe`),
    armed on every `every`-th step, the history of every measurement and the latest one, to log once."""

    def __init__(self, every: int, owner: str) -> None:
        self.every = every
        self.owner = owner
        self.history: list[dict[str, float]] = []
        """Every measurement: {"step": ..., signal: value, ...}; the smoothed trigger signal as "trigger"."""
        self.latest: dict[str, float] = {}
        """The last measurement, summarised for logging (`untie/<key>`); cleared by `take_latest`."""
        self.probe: RoleGradientProbe | None = None
        self.unmeasured_said = False

    def measures(self, step: int) -> bool:
        """Whether optimizer step `step` is a measurement step."""
        return self.every > 0 and step > 0 and step % self.every == 0

    def restart(self, history: list[dict[str, float]], step: int) -> None:
        """A run (re)starting at `step`: the history up to it, nothing pending."""
        self.history = [h for h in history if h["step"] <= step]
        self.latest, self.unmeasured_said = {}, False

    def watch(self, model: nn.Module, pairs: list[tuple[int, int]], registry: Registry, emulation=None) -> None:
        """Measure the tied phase's role gradients from now on (a measurement costs O(|T| d) per rank: the rows the
        batch looked up; also sharded)."""
        self.stop()
        self.probe = RoleGradientProbe(model, pairs=pairs, emulation=emulation, registry=registry)

    def stop(self) -> None:
        if self.probe is not None:
            self.probe.remove()
            self.probe = None

    def arm(self, step: int) -> None:
        """Step `step` is about to run its first forward."""
        if self.probe is not None:
            self.probe.armed = self.measures(step)

    def measure(self, step: int, pairs: list[tuple[int, int]], divergence: DivergenceTrigger | None) -> None:
        """Step `step`'s gradients are complete: read the role signals off them and feed the trigger."""
        if self.probe is None or not self.probe.armed:
            return
        self.probe.armed = False
        grads = self.probe.collect()
        if grads is None:
            if not self.unmeasured_said:
                self.unmeasured_said = True
                _compat.warn_in_user_code(unmeasured(self.owner))
            return
        signals = role_signals_on_rows(grads, pairs=pairs)
        signals.update(self.probe.pair_measurements(grads))
        if divergence is not None:
            divergence.update(step, signals)
            signals["trigger"] = divergence.average if divergence.average is not None else math.nan
        self.record(step, signals)

    def record(self, step: int, metrics: dict[str, float]) -> None:
        self.history.append({"step": step, **metrics})
        self.latest = summarize_pair_metrics(metrics)  # the history keeps every pair

    def take_latest(self, untie_step: int | None) -> dict[str, float]:
        """The `untie/*` values to log now: the tying state (`untie_step`: the untie's, None while tied) and the last
        measurement (once). A value not measured yet (a pair whose symbol has not occurred, the trigger before its
        first average: NaN in `history`) is left out, not logged as NaN."""
        logs = {"untie/tied": 1.0 if untie_step is None else 0.0}
        if untie_step is not None:
            logs["untie/untie_step"] = untie_step
        logs.update({f"untie/{k}": v for k, v in self.latest.items() if not math.isnan(v)})
        self.latest = {}
        return logs


def unmeasured(owner: str) -> str:
    """A measurement step ran no backward through the tied matrix's two roles."""
    return (
        f"{owner}: a measurement step ran no backward through the tied matrix's two roles, so the role signals (and "
        "the divergence trigger, which then waits for the deadline) are missing. Is the matrix frozen? Under "
        "torch.compile, module hooks added after a model of the same class was compiled in this process are not "
        "traced (torch._dynamo.config.skip_nnmodule_hook_guards): call torch._dynamo.reset() before building the "
        "Trainer."
    )
