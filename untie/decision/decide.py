"""The run's one decision: `decide(facts, settings, saved, step) -> Decision`.

What a run does with its model is decided here and nowhere else: the policy's choice, the schedule (the deadline and
the trigger's rule), how a head untied before the first step starts and whether the first batch judges it, a resume's
continuation, the structure the model needs at a start and at a resume (`untie.decision.plan.plan_structure`), and
every warning or refusal about a setting that cannot apply. It decides from four things:

* `Facts`: what the model is, read by the run (`untie.core.run`) at attach and read again only when a fact changes:
  the model's structure after a plan changed it, the first batch's verdict on a drawn head;
* `Settings`: the user's settings (`untie.UntieConfig`), the adapter and the tying mode resolved for the engine;
* `saved`: what a checkpoint says about the run that wrote it (`SavedFacts`), None for a fresh start, or `PENDING`
  while the adapter does not know yet (Trainer learns it in `train()`): the default's untie before the first step
  then waits;
* `step`: the optimizer step the run (re)starts at.

It is pure (plain values in, a plain value out; it reads no tensor), so every case is a row of
`tests/test_decision.py`. `untie.core.run.UntieRun` carries the decision out and says its warnings once each.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from untie.decision.plan import ModelFacts, RunSettings, SavedFacts, StructurePlan, plan_structure
from untie.decision.policy_rules import PolicyChoice, PolicyReading, choose, settle
from untie.decision.settings import DEFAULT_POLICY, SCHEDULE_SETTINGS, UntieConfig
from untie.decision.share_bands import scale_clause
from untie.decision.triggers import UntieWhen
from untie.errors import UntieValueError


class _Pending:
    """A checkpoint the adapter will know later (`PENDING`)."""

    def __repr__(self) -> str:
        return "PENDING"


#: `decide(saved=PENDING)`: whether a checkpoint loads is not known yet (Trainer's `train()` will say).
PENDING = _Pending()

HeadStart = Literal["model", "copy"]


@dataclass(frozen=True)
class Facts:
    """What the run knows about its model (read by `untie.structure.facts.read_facts`)."""

    model: ModelFacts
    tied: bool
    """It arrived tied, and not as a checkpoint this library untied (`was_untied`)."""
    reading: PolicyReading | None = None
    """What the policy read (`untie.structure.policy.read_for_policy`); None: it reads nothing (policy "off", PEFT)."""
    pairs: bool = False
    """The run measures pairs (given, or read from the tokenizer)."""
    no_pairs_because: str | None = None
    """Why no pairs were read (for the pair-free rule's notice)."""
    head_replaceable: bool = True
    """The first forward can replace a drawn head in place (not sharded by FSDP2 or DeepSpeed, not split)."""
    first_batch: tuple[HeadStart, str] | None = None
    """The first batch's verdict on a drawn head (`untie.structure.head_start`): the start it keeps, and why."""
    scale_blocked_by: str | None = None
    """Why a learning-rate scale the policy chose cannot apply (DeepSpeed's engine owns the param groups; the input
    embedding is frozen); None: it can."""
    arrived_untied: bool = False
    """It arrived untied with a head of its own (not a PEFT split its config does not record)."""
    engine: str | None = None
    """The training engine ("FSDP2", "DEEPSPEED"; None: DDP, one process)."""


@dataclass(frozen=True)
class Settings:
    """What the decision takes from the user and the adapter."""

    config: UntieConfig
    adapter: str
    """The adapter's name, as users wrote it: every message names it."""
    tokenizer_hint: str = "tokenizer=tokenizer"
    """How a tokenizer reaches the adapter (for the pair messages)."""
    tying_mode: Literal["live", "emulated"] = "live"
    """`config.tying_mode` resolved for the training engine."""


@dataclass(frozen=True)
class Decision:
    """What the run does (`decide`)."""

    choice: PolicyChoice
    """What the policy chose, settled by the checkpoint and the first batch (the line at train begin says it)."""
    untie_at: int | float | None
    """The deadline the run follows: 0 where it trains untied from the start, else `config.untie_at`."""
    rule: UntieWhen | None
    """The divergence trigger's rule ("divergence" resolved for the pairs); None: no trigger."""
    head_init: HeadStart
    """How a head untied before the first step starts: drawn by the model's initialiser or a copy of the embedding."""
    judge_first_batch: bool
    """A head drawn by default is provisional: the first forward keeps it only where the copy predicts no better."""
    start: StructurePlan
    """The structure the model needs to start this run."""
    resume: StructurePlan | None
    """The structure the checkpoint's run needs (None without a known checkpoint)."""
    waits: bool = False
    """The default's untie before the first step waits for the checkpoint (`saved` is `PENDING`)."""
    warnings: tuple[tuple[str, type[Warning]], ...] = ()
    """What to tell the user, once each, in their code (a setting that does not apply, a retired policy)."""
    notices: tuple[str, ...] = ()
    """What to log once each as a warning (the rule that changed for lack of pairs)."""
    refusal: str | None = None
    """A setting that cannot apply: raised before anything changes."""
    embedding_lr_scale: float = 1.0
    """The input embedding's rate scale the run trains with: the user's (`config.embedding_lr_scale`), or where none
    was given, the one policy "by-share" chose with an untie before the first step."""

    @property
    def untied_from_start(self) -> bool:
        return self.choice.untied_from_start and not self.waits


def decide(facts: Facts, settings: Settings, saved: SavedFacts | _Pending | None = None, step: int = 0) -> Decision:
    """The run's plan for a model with `facts` under `settings`, starting fresh (`saved` None), resuming the run
    `saved` describes, or before the adapter knows which (`PENDING`), at optimizer step `step`."""
    config, owner = settings.config, settings.adapter
    policy, why = config.chosen_policy()
    fresh = choose(policy, tied=facts.tied, peft=facts.model.peft, reading=facts.reading)
    if why and policy == "off" and config.policy is None:  # the schedule was set: that is the whole reason
        fresh = dataclasses.replace(fresh, reason=why)
    elif why:
        fresh = dataclasses.replace(fresh, reason=f"{fresh.reason} ({why})")

    waits = saved is PENDING and fresh.untied_from_start
    known = saved if isinstance(saved, SavedFacts) else None
    choice = fresh if waits else settle(fresh, known)
    warnings = _setting_warnings(facts, settings, fresh, None if waits else choice)
    if choice.untied_from_start and facts.first_batch is not None:
        start, detail = facts.first_batch
        if start == "copy":  # the weights' evidence was wrong: the function says what the model is (trained)
            reason = f"at the first batch, {detail} (its embedding alone had read as a fresh draw)"
            choice = dataclasses.replace(choice, embedding_lr_scale=None)  # as for a loaded model: the user's rate
        else:
            reason = f"{choice.reason}; at the first batch, {detail}"
        choice = dataclasses.replace(choice, head_init=start, reason=reason)
    untied_now = choice.untied_from_start and not waits

    untie_at: int | float | None
    if untied_now:
        untie_at, rule = 0, None
    elif choice.tied_phase:  # the policy's own tied phase ("by-share"): to its fraction of the run, no trigger
        untie_at, rule = choice.untie_at, None
    else:
        untie_at, rule = config.untie_at, config.rule(with_pairs=config.pairs != [])
    rule, notice, refusal = _rule_for_pairs(rule, facts, settings, trigger_runs=not choice.untied_from_start)
    if rule is not None and config.metrics_every == 0:  # a policy's plan runs the schedule as set, trigger included
        refusal = refusal or (
            f"{owner}: {choice.reason or 'the schedule runs as set'}, with the trigger (untie_when="
            f"{config.untie_when!r}), which reads measurements, and metrics_every=0 takes none: set metrics_every > 0 "
            "(e.g. 50), or untie_when=None for a fixed schedule at untie_at."
        )
    refusal = _engine_refusal(config, facts.engine, owner) or refusal

    scale, choice = _embedding_scale(config, choice, untied_now and known is None, facts)
    head_init = _head_start(config, choice)
    judge = (
        untied_now
        and head_init == "model"
        and config.head_init == "auto"
        and config.from_scratch is not True
        and facts.head_replaceable
        and facts.first_batch is None
        and step == 0
    )
    by_default = fresh.untied_from_start and config.policy is None  # before a checkpoint settled it
    run_settings = RunSettings(
        owner, untie_at, settings.tying_mode, config.tying_mode, config.tie_init, by_default, head_init == "model"
    )
    return Decision(
        choice=choice,
        untie_at=untie_at,
        rule=rule,
        head_init=head_init,
        judge_first_batch=judge,
        start=plan_structure(facts.model, run_settings),
        resume=plan_structure(facts.model, run_settings, known) if known is not None else None,
        waits=waits,
        warnings=tuple(warnings),
        notices=(notice,) if notice else (),
        refusal=refusal,
        embedding_lr_scale=scale,
    )


def _setting_warnings(
    facts: Facts, settings: Settings, fresh: PolicyChoice, settled: PolicyChoice | None
) -> list[tuple[str, type[Warning]]]:
    """What to tell the user about their settings, once each: a retired policy, the weights' evidence against the
    config's name, and a setting the plan (`settled` by the checkpoint; None while that waits) does not use."""
    config, owner = settings.config, settings.adapter
    warnings: list[tuple[str, type[Warning]]] = []
    if fresh.policy == "auto":
        retired = (
            f"{owner}(policy='auto'): 'auto' is retired (its held-out validation failed, "
            f"docs/recipes/decision-map.md). Leave policy unset for the default ({DEFAULT_POLICY!r}), or pass "
            "policy='off'."
        )
        warnings.append((retired, FutureWarning))
    if fresh.warning is not None:
        warnings.append((f"{owner}: {fresh.warning}", UserWarning))
    unused = unused_setting(config, settled, owner) if settled is not None else None
    if unused is not None:
        warnings.append((unused, UserWarning))
    if config.tie_init is not None and facts.tied and not facts.model.peft:
        unused_tie = (
            f"{owner}: tie_init={config.tie_init!r} changes nothing here: the model arrived tied (tie_init chooses the "
            "matrix a model that arrives untied is tied from). Leave tie_init unset."
        )
        warnings.append((unused_tie, UserWarning))
    return warnings


def _embedding_scale(
    config: UntieConfig, choice: PolicyChoice, fresh_start: bool, facts: Facts
) -> tuple[float, PolicyChoice]:
    """The input embedding's rate scale: the user's where given (a resume's: the checkpoint's); else the policy's,
    on a fresh start untied before the first step, except where a scale cannot apply (`Facts.scale_blocked_by`: the
    choice's reason then says the embedding trains at the user's rate); else 1. Returns the scale and the choice, its
    reason true to the scale."""
    asked = choice.embedding_lr_scale
    if asked is None:
        return config.embedding_lr_scale, choice
    band = choice.reason.replace(scale_clause(asked), "")  # the reason without the scale the band would give
    if config.was_set("embedding_lr_scale") or not fresh_start:
        whose = "the checkpoint's" if "embedding_lr_scale" in config.from_checkpoint else "your"
        reason = f"{band}; the input embedding trains at {whose} embedding_lr_scale={config.embedding_lr_scale:g}"
        return config.embedding_lr_scale, dataclasses.replace(choice, reason=reason, embedding_lr_scale=None)
    if facts.scale_blocked_by is not None:
        reason = f"{band}; the input embedding trains at your rate, not the band's {asked:g}x: {facts.scale_blocked_by}"
        return config.embedding_lr_scale, dataclasses.replace(choice, reason=reason, embedding_lr_scale=None)
    return asked, choice


def _engine_refusal(config: UntieConfig, engine: str | None, owner: str) -> str | None:
    """A learning-rate scale the engine cannot apply: DeepSpeed's engine owns the param groups (never a silent 1.0)."""
    if engine != "DEEPSPEED" or (config.embedding_lr_scale, config.head_lr_scale) == (1.0, 1.0):
        return None
    return (
        f"{owner}: DeepSpeed's engine owns the param groups, so embedding_lr_scale / head_lr_scale cannot be applied "
        "under it: leave them at 1.0, or train under DDP or FSDP2."
    )


def check_run_length(decision: Decision, owner: str, max_steps: int | None) -> None:
    """Refuse a run of unknown length (`max_steps` None: a custom loop) where the policy chose a tied phase to a
    fraction of the run ("by-share"), naming the fixes."""
    if not (decision.choice.tied_phase and isinstance(decision.untie_at, float) and max_steps is None):
        return
    raise UntieValueError(
        f"{owner}: {decision.choice.reason}; this run's length is unknown. Pass max_steps, or choose a plan that needs "
        "none: untie_at=<step> with untie_when=None, or policy='untie-at-start'."
    )


def checkpoint_config(config: UntieConfig, decision: Decision | None) -> UntieConfig:
    """The settings a checkpoint keeps: `config`, with an input embedding's rate scale the policy chose itself
    ("by-share") written as a setting, so that a resume continues it (`untie.checkpoints.saved_state.resumed_config`)
    whatever its trained weights now read as. A tied phase it chose is in the run state's policy instead, which a
    resume reads as `SavedFacts.policy_phase` (`untie.decision.policy_rules.settle`)."""
    if decision is None or decision.choice.policy != config.chosen_policy()[0]:
        return config
    if decision.choice.policy == "by-share" and not config.was_set("embedding_lr_scale"):
        # whatever it chose, 1x included: a resume's first batch is not judged again, and its weights may read fresh
        config = config.replace(embedding_lr_scale=decision.embedding_lr_scale)
    return config  # a tied phase it chose: the run state's policy says it (`SavedFacts.policy_phase`)


def _head_start(config: UntieConfig, choice: PolicyChoice) -> HeadStart:
    """How a head untied before the first step starts: `config.head_init`, "auto" following the policy's choice, or
    your word that the model is built fresh (``untie_at=0, from_scratch=True``)."""
    if config.head_init != "auto":
        return "model" if config.head_init == "model" else "copy"
    if config.from_scratch is True:
        return "model"
    return "model" if choice.untied_from_start and choice.head_init == "model" else "copy"


def _rule_for_pairs(
    rule: UntieWhen | None, facts: Facts, settings: Settings, *, trigger_runs: bool
) -> tuple[UntieWhen | None, str | None, str | None]:
    """The rule for the pairs the run measures, a notice where the default's rule changed, and a refusal where a rule
    the user chose reads pairs there are none of."""
    if rule is None or facts.pairs or not rule.reads_pairs:
        return rule, None, None
    config = settings.config
    if config.is_default_rule:
        notice = None
        if config.pairs is None and trigger_runs:  # pairs=[] is the user's choice; pairs="auto" has warned already
            notice = (
                f"untie: the default trigger reads no pairs: {facts.no_pairs_because or 'no tokenizer was given'}. It "
                "uses the pair-free rule (untie_when='cancellation') instead of the evidence rule. To measure pairs, "
                f"pass the tokenizer ({settings.tokenizer_hint}) or pairs=[(id_a, id_b), ...]; "
                "untie_when='cancellation' chooses this rule and silences this message."
            )
        return config.rule(with_pairs=False), notice, None  # "divergence" without pairs: the pair-free rule
    refusal = (
        f"untie_when.signal={rule.signal!r} reads pairs, and there are none: no tokenizer to read them from "
        f"({settings.tokenizer_hint}) or its vocabulary has no case or word-start variants. Pass pairs=[(id_a, "
        "id_b), ...], or a pair-free rule (untie_when='cancellation')."
    )
    return rule, None, refusal


def unused_setting(config: UntieConfig, choice: PolicyChoice, owner: str) -> str | None:
    """A setting the plan `choice` made for `config` does not use, in words (None where every setting counts):
    `from_scratch` decides only the default's plan and how a head untied before the first step starts, and
    `head_init="model"` only a head untied before the first step."""
    untie_at = 0 if choice.untied_from_start else config.untie_at
    drawn_over_trained = choice.untied_from_start and choice.head_init == "copy" and config.from_scratch is not True
    if drawn_over_trained and config.head_init == "model":
        return (
            f"{owner}: head_init='model' draws the head over a model that counts as trained ({choice.reason}): its "
            "trained output role is dropped, as asked. Leave head_init unset to start the head as a copy, or pass "
            "from_scratch=True if the model is built fresh."
        )
    if choice.tied_phase and config.policy not in (None, "off"):
        given = [name for name in SCHEDULE_SETTINGS if config.was_set(name)]
        if given:
            settings = ", ".join(f"{name}={getattr(config, name)!r}" for name in given)
            return (
                f"{owner}: {settings} changes nothing here: policy={config.policy!r} runs its own tied phase for this "
                f"model ({choice.reason}). Pass policy='off' to run the schedule as set, or leave the policy unset (a "
                "schedule set then runs as set)."
            )
    if choice.untied_from_start and config.policy not in (None, "off"):
        # A schedule that asks for a tied phase: an untie_at after step 0 (or none), or a trigger.
        tied_phase = {"untie_at": config.untie_at != 0, "untie_when": config.untie_when is not None}
        asked = [name for name in SCHEDULE_SETTINGS if config.was_set(name) and tied_phase[name]]
        if asked:
            settings = ", ".join(f"{name}={getattr(config, name)!r}" for name in asked)
            return (
                f"{owner}: {settings} changes nothing here: policy={config.policy!r} trains this model untied from "
                f"the first step ({choice.reason}). Pass policy='off' to run the schedule as set, or leave the "
                "policy unset (a schedule set then runs as set)."
            )
    if untie_at == 0:
        return None
    later = f"this run unties later ({choice.reason}), and a head untied after step 0 starts as a copy of the embedding"
    if config.head_init == "model":
        return (
            f"{owner}: head_init='model' draws a head untied before the first step; {later}. Pass from_scratch=True "
            "if the model is built fresh (it then trains untied from step 0, its head drawn), or leave head_init unset."
        )
    if config.from_scratch is not None and choice.policy == "off" and config.continues_checkpoint:
        return (
            f"{owner}: from_scratch={config.from_scratch!r} changes nothing here: the run continues its checkpoint's "
            f"schedule, so {later}. Leave from_scratch unset."
        )
    if config.from_scratch is not None and choice.policy == "off":
        return (
            f"{owner}: from_scratch={config.from_scratch!r} changes nothing here: the schedule is set (policy 'off'), "
            f"so {later}. Leave the schedule unset for the default's plan, or pass untie_at=0 with from_scratch=True "
            "to train untied from step 0 with a drawn head."
        )
    return None
