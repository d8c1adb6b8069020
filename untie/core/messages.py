"""What a run says about itself, in words: the one line at train begin (`plan_line`), a resume under changed settings
(`changed_settings`), a run too short for its trigger (`short_run_notice`). Each reads what a run shows (`SpokenRun`,
which `untie.core.run.UntieRun` is) and changes nothing: the run decides, this says it. It imports nothing of the run
itself, so no import, even a type-only one, leads back from here to it."""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Protocol

from untie import _compat
from untie.decision.decide import ARRIVED_UNTIED, tied_text, untie_when_text, untied_from_start_text
from untie.decision.settings import UntieConfig
from untie.decision.triggers import UntieWhen, rule_name
from untie.structure.peft_support import split_by_peft
from untie.structure.surgery import is_tied, untie_recorded

if TYPE_CHECKING:
    from torch import nn

    from untie.core.measuring import Measurements
    from untie.core.model_structure import ModelStructure
    from untie.decision.decide import Decision
    from untie.decision.policy_rules import PolicyChoice
    from untie.decision.triggers import DivergenceTrigger, ScheduledTrigger
    from untie.structure.role_rates import RoleRates


class SpokenRun(Protocol):
    """What the lines read off a run (`untie.core.run.UntieRun` is one): its settings, its decision and schedule, and
    where it stands. Read-only."""

    @property
    def owner(self) -> str: ...
    @property
    def config(self) -> UntieConfig: ...
    @property
    def choice(self) -> PolicyChoice | None: ...
    @property
    def decision(self) -> Decision | None: ...
    @property
    def deadline(self) -> ScheduledTrigger: ...
    @property
    def divergence(self) -> DivergenceTrigger | None: ...
    @property
    def untied(self) -> bool: ...
    @property
    def untie_step(self) -> int | None: ...
    @property
    def untie_reason(self) -> str | None: ...
    @property
    def arrived_untied(self) -> bool: ...
    @property
    def pairs(self) -> list[tuple[int, int]]: ...
    @property
    def model(self) -> nn.Module | None: ...
    @property
    def structure(self) -> ModelStructure | None: ...
    @property
    def rates(self) -> RoleRates: ...
    @property
    def measurements(self) -> Measurements: ...


logger = logging.getLogger(__name__)


def say_once(said: set[str], texts) -> None:
    """Say each of `texts` ((text, warning category) pairs; category None: a logged warning) not in `said` yet (a
    run's record: each once per run), in the user's code."""
    for text, category in texts:
        if text not in said:
            said.add(text)
            if category is None:
                logger.warning(text)
            else:
                _compat.warn_in_user_code(text, category)


def announce(run: SpokenRun, step: int, max_steps: int | None) -> str:
    """Say what the run begun at `step` will do, in one line in its own numbers (`plan_line`; returned, the run keeps
    it in its state): a warning where a policy decided, a note where the schedule was set; and a trigger that cannot
    fire in the run (`short_run_notice`)."""
    line = plan_line(run, step, max_steps)
    rates = run.rates.line()
    line = f"{line}; {rates.removeprefix('untie: ')}" if rates else line
    decided = run.choice is not None and run.choice.policy != "off"
    logger.log(logging.WARNING if decided else logging.INFO, line)
    if run.measurements.probe is not None:
        short_run_notice(run, step, max_steps)
    return line


def plan_line(run: SpokenRun, step: int, max_steps: int | None) -> str:
    """What the run begun at `step` of `max_steps` will do and why: "untie: trains untied from step 0; the head is
    drawn by the model's initialiser, because ..." / "untie: trains tied; unties when the divergence trigger fires,
    at step 1,234 at the latest, because ..."."""
    start = f"resumed at step {step:,}: " if step else ""
    if run.untied:
        if run.untie_step is not None and run.untie_step < step:
            return f"untie: {start}trains untied (untied at step {run.untie_step:,}, {run.untie_reason})"
        if step and run.untie_reason == "deadline":  # a tied phase resumed past its deadline (settings changed)
            passed = f"step {run.deadline.step:,}, untie_at={run.deadline.untie_at!r}"
            return (
                f"untie: {start}the checkpoint's run was tied and its deadline ({passed}) has passed, so it unties "
                "now; the head starts as a copy of the embedding"
            )
        if run.arrived_untied:
            return f"untie: {start}{ARRIVED_UNTIED}"
        model = run.model
        split = None if model is None else split_by_peft(model, tied=is_tied(model), recorded=untie_recorded(model))
        if split is not None:
            return f"untie: {start}trains untied from step 0: {split}"
        asked = " (untie_at=0)" if run.config.was_set("untie_at") and run.config.untie_at == 0 else ""
        head = run.decision.head_init if run.decision is not None else "copy"
        reason = run.choice.reason if run.choice is not None else None
        return f"untie: {start}{untied_from_start_text(head, reason, step, asked)}"
    deadline = ""
    if run.deadline.step is not None:
        at = run.deadline.untie_at
        setting = f"untie_at={at!r} of {max_steps:,}" if isinstance(at, float) and max_steps else f"untie_at={at!r}"
        deadline = f"at step {run.deadline.step:,} ({setting})"
    when = untie_when_text(deadline, rule_name(run.divergence.rule) if run.divergence is not None else None)
    emulated = run.structure is not None and run.structure.emulation is not None
    reason = run.choice.reason if run.choice is not None else None
    return f"untie: {start}{tied_text(when, reason, emulated)}"


def warn_changed_settings(run: SpokenRun, saved_config: dict, step: int) -> None:
    """Warn, in the user's code, where a resume runs under other schedule settings than its checkpoint's
    (`changed_settings`)."""
    changed = changed_settings(run, saved_config, step)
    if changed is not None:
        _compat.warn_in_user_code(changed)


def changed_settings(run: SpokenRun, saved_config: dict, step: int) -> str | None:
    """What a resume at `step` under other schedule settings than the checkpoint's run (`saved_config`, as JSON)
    does, in words; None where they are the same. A setting the checkpoint leaves out was not set: its default."""
    now = json.loads(json.dumps(run.config.values()))
    defaults = json.loads(json.dumps(UntieConfig().values()))
    then = {k: saved_config.get(k, defaults[k]) for k in ("untie_at", "untie_when")}
    changed = [k for k in then if not _same(run, k, then[k], now[k])]
    if not changed:
        return None
    what = ", ".join(f"{k}: {then[k]!r} -> {now[k]!r}" for k in changed)
    if run.untied:
        return (
            f"{run.owner}: resumed with changed settings ({what}), which have no effect: the checkpoint's run "
            f"untied at step {run.untie_step} ({run.untie_reason}) and a resumed run does not re-tie."
        )
    kept = [f"{k}={then[k]!r}" for k in changed if k in saved_config]  # set by the checkpoint's run
    unset = [k for k in changed if k not in saved_config]  # left at its default by the checkpoint's run
    fixes = [f"pass {', '.join(kept)} (the checkpoint's)"] if kept else []
    fixes += [f"leave {' and '.join(unset)} unset, as the checkpoint's run did"] if unset else []
    fix = " and ".join(fixes) + ("" if unset else f", or leave {'it' if len(kept) == 1 else 'them'} unset")
    return (
        f"{run.owner}: resumed at step {step} with changed settings ({what}); the tied run continues under the new "
        f"ones (a deadline already passed unties at the resume step). To keep the checkpoint's plan, {fix}: a "
        "setting left unset at a resume takes the checkpoint's value."
    )


def _same(run: SpokenRun, key: str, saved, now) -> bool:
    """Whether a checkpoint's setting (JSON) is this run's (`now`); rules compare by what they resolve to."""
    if key != "untie_when":
        return saved == now
    try:
        then = UntieWhen.coerce(saved, with_pairs=bool(run.pairs))
        asked = UntieWhen.coerce(run.config.untie_when, with_pairs=bool(run.pairs))
    except (TypeError, ValueError):
        return False
    return (then and then.to_dict()) == (asked and asked.to_dict())


def short_run_notice(run: SpokenRun, step: int, max_steps: int | None) -> None:
    """Say once when `metrics_every` leaves the trigger too few measurements before the deadline (or the run's end)
    to fire, or leaves no measurement at all. A warning where it matters to what the user asked: the trigger was set
    (`untie_when`), or there is no deadline, so the model stays tied because the trigger cannot fire. A note (logged)
    where the default trigger of a short fine-tune leaves the untie at the deadline the plan line already gave: the
    run does what it said (issue 69: every fine-tune under 500 steps was warned)."""
    every, last = run.config.metrics_every, run.deadline.step or max_steps
    if last is None:  # an open-ended custom loop: nothing to count against
        return
    if run.divergence is not None:
        chances, needed = run.divergence.chances(every, last), run.divergence.rule.patience
        if chances >= needed:
            return
        fit = max(1, (last - max(run.divergence.warmup_step, 1) + 1) // needed)
        what = f"the model unties at the deadline, step {last}" if run.deadline.step else "the model stays tied"
        message = (
            f"{run.owner}: metrics_every={every} leaves the divergence trigger {chances} measurement(s) after its "
            f"warm-up (step {run.divergence.warmup_step}) and by step {last}; it needs {needed} in a row to fire, so "
            f"it cannot fire and {what}. Pass metrics_every <= {fit} to give it a chance, or untie_when=None for a "
            "plain schedule at untie_at."
        )
        if run.config.was_set("untie_when") or run.deadline.step is None:
            _compat.warn_in_user_code(message)
        else:  # the default trigger, and the deadline the plan line named: a note
            logger.info("untie: %s", message)
    elif every > last - step:  # no trigger reads them: a note, not a warning
        logger.info(
            "untie: metrics_every=%d measures nothing by step %d (the %s); pass a smaller metrics_every to see the "
            "role signals, or metrics_every=0 to turn them off.",
            every,
            last,
            "untie" if run.deadline.step else "end of the run",
        )
