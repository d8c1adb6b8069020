"""`RunViews`: the run state both adapters show their users, read-only (`untie.UntieCallback`, `untie.Untier`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from untie.decision.triggers import DivergenceTrigger, ScheduledTrigger, UntieWhen
from untie.structure.policy import PolicyChoice

if TYPE_CHECKING:
    from untie.core.run import UntieRun


class RunViews:
    """The run state both adapters show their users, read-only, from their run (`run`, an `UntieRun`): one view for
    `untie.UntieCallback` and `untie.Untier`."""

    run: UntieRun

    @property
    def untied(self) -> bool:
        """Whether the model has been untied."""
        return self.run.untied

    @property
    def untie_step(self) -> int | None:
        """The optimizer step of the untie (None while tied)."""
        return self.run.untie_step

    @property
    def untie_reason(self) -> str | None:
        """Why the model was untied: "trigger", "deadline", "checkpoint" or "start"."""
        return self.run.untie_reason

    @property
    def history(self) -> list[dict[str, float]]:
        """Every measurement: {"step": ..., signal: value, ...}."""
        return self.run.measurements.history

    @property
    def trigger_state(self) -> dict | None:
        """The divergence trigger's running state (None without one)."""
        divergence = self.run.divergence
        return divergence.state_dict() if divergence is not None else None

    @property
    def pairs(self) -> list[tuple[int, int]]:
        """The measured pairs: `config.pairs`, or those read from the tokenizer."""
        return self.run.pairs

    @property
    def policy_choice(self) -> PolicyChoice | None:
        """What the policy chose for the model, and why (`untie.structure.policy.PolicyChoice`)."""
        return self.run.choice

    @property
    def plan(self) -> str | None:
        """What the run said at train begin it would do, in its own numbers (`untie.decision.lines.plan_line`)."""
        return self.run.plan

    @property
    def tying_mode(self) -> str | None:
        """The tied phase's implementation, "live" or "emulated"."""
        return self.run.structure.tying_mode if self.run.structure is not None else None

    @property
    def rule(self) -> UntieWhen | None:
        """The trigger's rule (`untie.UntieWhen`), "divergence" resolved for the pairs; None."""
        return self.run.rule

    @property
    def divergence(self) -> DivergenceTrigger | None:
        """The divergence trigger (`untie.decision.triggers.DivergenceTrigger`) or None."""
        return self.run.divergence

    @property
    def deadline(self) -> ScheduledTrigger:
        """`untie_at` (`untie.decision.triggers.ScheduledTrigger`)."""
        return self.run.deadline
