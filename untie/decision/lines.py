"""What a run says, in words, rendered from plain values: the one line at train begin (`plan_line`), a resume under
changed settings (`changed_settings`), a trigger too short of measurements to fire (`short_run_notice`), and the plan
`untie inspect` prints (`default_plan_text`).

Each reads a `RunSummary` (where the run stands, as values: `untie.core.run.UntieRun.summary` makes it) and the
run's decision (`untie.decision.decide.Decision`), never the run object or the model. Torch-free, like the rest of
this package; `untie.core.messages` logs or warns what these return.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from untie.decision.decide import Decision
from untie.decision.plan import MERGE_RECORDS_THE_SPLIT
from untie.decision.policy_rules import PolicyChoice
from untie.decision.settings import UntieConfig
from untie.decision.triggers import UntieWhen, measurement_chances, rule_name

#: How a head untied before the first step starts, in the words of the run's line and of `untie inspect`.
HEAD_STARTS = {
    "model": "the head is drawn by the model's initialiser (head_init)",
    "copy": "the head starts as a copy of the embedding (head_init)",
}
#: A model that arrives untied, in the same words.
ARRIVED_UNTIED = "trains untied from step 0; the model arrived untied: its head is its own matrix"


@dataclass(frozen=True)
class RunSummary:
    """Where a run stands, as plain values: what its lines are rendered from."""

    owner: str
    """The adapter's name, as users wrote it."""
    config: UntieConfig
    decision: Decision | None
    untie_at: int | float | None
    """The deadline's setting (a step or a fraction of the run; 0: untied from the start)."""
    deadline_step: int | None = None
    """The deadline's step, once the run's length is known."""
    rule: UntieWhen | None = None
    """The divergence trigger's rule in force; None: no trigger."""
    warmup_step: int = 0
    """The trigger's warm-up, in steps (resolved for the run's length)."""
    untie_step: int | None = None
    untie_reason: str | None = None
    """Why it untied: "trigger", "deadline", "checkpoint" or "start"."""
    arrived_untied: bool = False
    """The model arrived untied (its head is its own matrix)."""
    pairs: bool = False
    """The run measures pairs."""
    peft_split: tuple[str, ...] = ()
    """The roles to which PEFT's `modules_to_save` gave a copy of the tied matrix (`untie.decision.plan.ModelFacts`)."""
    emulated: bool = False
    """The tied phase is emulated (FSDP2, DeepSpeed)."""
    measuring: bool = False
    """The run reads the role signals (a probe is installed)."""
    rates: str | None = None
    """The per-role learning rates' line (`untie.structure.role_rates.RoleRates.line`); None: one rate."""

    @property
    def untied(self) -> bool:
        return self.untie_step is not None


def untied_from_start_text(head_init: str, reason: str | None, step: int = 0, asked: str = "") -> str:
    """A plan that unties before the first step, in words: "trains untied from step 0; the head ..., because ..."
    (the line at train begin, `plan_line`, and `untie inspect` say it alike)."""
    why = f", because {reason}" if reason else ""
    return f"trains untied from step {step:,}{asked}; {HEAD_STARTS[head_init]}{why}"


def tied_text(when: str, reason: str | None, emulated: bool = False) -> str:
    """A plan with a tied phase, in words: "trains tied; unties when ...; the head starts as a copy of the embedding,
    because ..."; `when` says when it unties (`untie_when_text`)."""
    why = f", because {reason}" if reason else ""
    tied = "trains tied (emulated tying)" if emulated else "trains tied"
    return f"{tied}; {when}; the head starts as a copy of the embedding{why}"


def untie_when_text(deadline: str, rule: str | None) -> str:
    """When a tied phase ends, in words: `deadline` ("at step 1,234 (untie_at=0.3 of 4,000)", or "" for none) and the
    trigger's rule by name (None: no trigger)."""
    if rule is not None:
        latest = f", {deadline} at the latest" if deadline else " (no deadline)"
        return f"unties when the divergence trigger ({rule}) fires{latest}"
    if deadline:
        return f"unties {deadline}"
    return "stays tied (untie_at=None, untie_when=None)"


def peft_split_text(roles: tuple[str, ...]) -> str:
    """What PEFT did to a tied model it wrapped with `modules_to_save`, giving `roles` a copy of the tied matrix."""
    return (
        f"PEFT's modules_to_save gave the {' and the '.join(roles)} a trainable copy of the tied matrix, so PEFT "
        "untied the model when it wrapped it and this library has nothing to untie; merge_and_unload() records the "
        f"untie (tie_word_embeddings=False, peft >= {MERGE_RECORDS_THE_SPLIT})"
    )


def default_plan_text(choice: PolicyChoice, tied: bool) -> str:
    """The default settings' plan for a model that arrives `tied` or not, under `choice`, in the words of the run's
    line at train begin: what `untie inspect` says before the run's length is known (a deadline as its setting)."""
    if not tied:
        return ARRIVED_UNTIED
    if choice.untied_from_start:
        return untied_from_start_text(choice.head_init, None)
    if choice.tied_phase:  # the policy's own tied phase: to a fraction of the run, no trigger
        deadline = f"at untie_at={choice.untie_at!r}" if choice.untie_at is not None else ""
        return tied_text(untie_when_text(deadline, None), None)
    defaults = UntieConfig()
    rule = defaults.rule(with_pairs=True)  # inspect reads the checkpoint tokenizer's pairs, as Trainer's run does
    deadline = f"at untie_at={defaults.untie_at!r}" if defaults.untie_at is not None else ""
    return tied_text(untie_when_text(deadline, rule_name(rule) if rule is not None else None), None)


#: `RunSummary.untie_reason` in words, for a resumed run's line.
UNTIE_REASON_WORDS = {
    "trigger": "when the divergence trigger fired",
    "deadline": "at its deadline",
    "start": "before the first step",
    "checkpoint": "as the checkpoint it resumed from was",
}


def plan_line(run: RunSummary, step: int, max_steps: int | None) -> str:
    """What the run begun at `step` of `max_steps` will do and why: "untie: trains untied from step 0; the head is
    drawn by the model's initialiser, because ..." / "untie: trains tied; unties when the divergence trigger fires,
    at step 1,234 at the latest, because ..."."""
    start = f"resumed at step {step:,}: " if step else ""
    reason = run.decision.choice.reason if run.decision is not None else None
    if run.untied:
        if run.untie_step is not None and run.untie_step < step:
            why = UNTIE_REASON_WORDS.get(run.untie_reason or "", run.untie_reason)
            return f"untie: {start}trains untied (untied at step {run.untie_step:,}{f', {why}' if why else ''})"
        if step and run.untie_reason == "deadline":  # a tied phase resumed past its deadline (settings changed)
            passed = f"step {run.deadline_step:,}, untie_at={run.untie_at!r}"
            return (
                f"untie: {start}the checkpoint's run was tied and its deadline ({passed}) has passed, so it unties "
                "now; the head starts as a copy of the embedding"
            )
        if run.arrived_untied:
            return f"untie: {start}{ARRIVED_UNTIED}"
        if run.peft_split:
            return f"untie: {start}trains untied from step 0: {peft_split_text(run.peft_split)}"
        asked = " (untie_at=0)" if run.config.was_set("untie_at") and run.config.untie_at == 0 else ""
        head = run.decision.head_init if run.decision is not None else "copy"
        return f"untie: {start}{untied_from_start_text(head, reason, step, asked)}"
    deadline = ""
    if run.deadline_step is not None:
        at = run.untie_at
        setting = f"untie_at={at!r} of {max_steps:,}" if isinstance(at, float) and max_steps else f"untie_at={at!r}"
        deadline = f"at step {run.deadline_step:,} ({setting})"
    when = untie_when_text(deadline, rule_name(run.rule) if run.rule is not None else None)
    return f"untie: {start}{tied_text(when, reason, run.emulated)}"


def changed_settings(run: RunSummary, saved_config: dict, step: int) -> str | None:
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


def _same(run: RunSummary, key: str, saved, now) -> bool:
    """Whether a checkpoint's setting (JSON) is this run's (`now`); rules compare by what they resolve to."""
    if key != "untie_when":
        return saved == now
    try:
        then = UntieWhen.coerce(saved, with_pairs=run.pairs)
        asked = UntieWhen.coerce(run.config.untie_when, with_pairs=run.pairs)
    except (TypeError, ValueError):
        return False
    return (then and then.to_dict()) == (asked and asked.to_dict())


def short_run_notice(run: RunSummary, step: int, max_steps: int | None) -> tuple[str, bool] | None:
    """Where `metrics_every` leaves the trigger too few measurements before the deadline (or the run's end) to fire,
    or leaves no measurement at all: the text, and whether it is a warning. A warning where it matters to what the
    user asked: the trigger was set (`untie_when`), or there is no deadline, so the model stays tied because the
    trigger cannot fire. A note (logged) where the default trigger of a short fine-tune leaves the untie at the
    deadline the plan line already gave: the run does what it said (issue 69: every fine-tune under 500 steps was
    warned). None: nothing to say."""
    every, last = run.config.metrics_every, run.deadline_step or max_steps
    if last is None:  # an open-ended custom loop: nothing to count against
        return None
    if run.rule is not None:
        chances, needed = measurement_chances(run.warmup_step, every, last), run.rule.patience
        if chances >= needed:
            return None
        fit = max(1, (last - max(run.warmup_step, 1) + 1) // needed)
        what = f"the model unties at the deadline, step {last}" if run.deadline_step else "the model stays tied"
        message = (
            f"{run.owner}: metrics_every={every} leaves the divergence trigger {chances} measurement(s) after its "
            f"warm-up (step {run.warmup_step}) and by step {last}; it needs {needed} in a row to fire, so "
            f"it cannot fire and {what}. Pass metrics_every <= {fit} to give it a chance, or untie_when=None for a "
            "plain schedule at untie_at."
        )
        warns = run.config.was_set("untie_when") or run.deadline_step is None
        return (message, True) if warns else (f"untie: {message}", False)
    if every > last - step:  # no trigger reads them: a note, not a warning
        what = "untie" if run.deadline_step else "end of the run"
        return (
            f"untie: metrics_every={every} measures nothing by step {last} (the {what}); pass a smaller "
            "metrics_every to see the role signals, or metrics_every=0 to turn them off.",
            False,
        )
    return None


def ended_tied_emulated_text(owner: str) -> str:
    """A run that ends in its emulated tied phase (a tied baseline under FSDP2 or DeepSpeed): its model holds two
    equal matrices, which save untied, and how to make them one again."""
    return (
        f"untie: the run ended tied under emulated tying ({owner}): the model holds the input embedding and an equal "
        "LM head, two matrices, and saves untied (tie_word_embeddings=False); it reloads to the same function. For one "
        "shared matrix, tie the saved model: `untie convert SAVED OUT --tie`, or untie.tie_embeddings(model, "
        "init='input') on the model loaded unsharded."
    )


def untied_text(step: int, reason: str) -> str:
    """The untie, as it happens between steps (logged)."""
    return (
        f"untie: untied the LM head from the input embedding at step {step} ({UNTIE_REASON_WORDS.get(reason, reason)})"
    )


def kept_copy_text(detail: str) -> str:
    """The first batch kept the copy of the embedding over the drawn head, and why (`detail`)."""
    return f"untie: the head starts as a copy of the embedding, not drawn: {detail}"


def tied_model_for_untied_state(owner: str) -> str:
    """Refusal: a run state that says untied, resumed into a tied model."""
    return (
        f"{owner}: the checkpoint state says the model was untied, but the model is tied. Resume with the same model "
        "class, or call untie.prepare_for_resume(model, checkpoint_dir) before loading it."
    )


def frozen_tied_embedding_text(owner: str) -> str:
    """Warning: a tied matrix the user froze unties into two identical frozen matrices."""
    return (
        f"{owner}: the tied embedding is frozen (requires_grad=False), so the head the untie gives its own matrix is "
        "frozen too and never trains: a copy stays equal to the embedding (one more matrix for nothing), a drawn head "
        "stays a draw. To train the head apart, unfreeze the embedding before the run attaches "
        "(model.get_input_embeddings().weight.requires_grad_(True)); to keep the model tied, pass untie_at=None, "
        "untie_when=None, metrics_every=0."
    )


def optimizer_state_first_text(owner: str, found: str) -> str:
    """Refusal: an optimizer state loaded before the run's own state, into param groups it does not fit (`found`: how
    they differ)."""
    return (
        f"{owner}: the optimizer's state was loaded before the run's: {found}. Resuming, load the run's state first: "
        "untier.start(optimizer), then untier.load_state_dict(state) (or accelerator.load_state), then the model's "
        "and the optimizer's state dicts; the optimizer then has the checkpoint's structure and groups. An optimizer "
        "state saved without untie cannot hold them: pass policy='off' and the schedule it was trained under, or start "
        "the optimizer afresh."
    )


def accelerator_missing_text(owner: str) -> str:
    """Refusal: an optimizer `accelerator.prepare` returned, given without its accelerator."""
    return (
        f"{owner}: the optimizer comes from accelerator.prepare, but no accelerator was given: pass "
        f"{owner}(model, optimizer, accelerator=accelerator, ...). Without it, each micro-batch of gradient "
        "accumulation counts as an optimizer step (the untie comes early), and accelerator.save_state / load_state do "
        "not carry the run's state (untie_state.json), so a resume starts the run again from step 0."
    )
