"""`UntieRun`: the state of a tie-then-untie run, and the execution of its decision; shared by every adapter.

It holds what a run remembers (the model's structure, `untie.core.model_structure.ModelStructure`; the deadline and the
divergence trigger; the untie; the measurements, `untie.core.measuring.Measurements`; the per-role learning rates,
`untie.structure.role_rates.RoleRates`) and carries out what `untie.decision.decide.decide` decides from the model's
facts, the settings and, on resume, the checkpoint; it decides again only when a fact changes. The adapters
(`untie.UntieCallback`, `untie.Untier`) call it in the order of `untie.core.phases`: `attach` before the optimizer
exists, `start` with it, then per optimizer step `t` (from 1) `arm(t)` before its first forward, `measure(t)` once its
gradients are complete and `end_of_step(t)` after it (the untie happens here); `close()` takes every install off
(`registry`). What the run says is worded from its `summary` (`untie.decision.lines`).
"""

from __future__ import annotations

import dataclasses
import logging

from torch import nn

from untie.checkpoints.checkpoint import has_resume_guard, resume_guard_hook
from untie.checkpoints.saved_state import check_state, resumed_config, run_state
from untie.core import measuring, messages
from untie.core.model_structure import ModelStructure
from untie.core.phases import BY_HAND, Adapter, RunOrderError, enter
from untie.decision import lines
from untie.decision.decide import PENDING, Decision, Facts, Settings, check_run_length, checkpoint_config, decide
from untie.decision.plan import SavedFacts, StructurePlan, saved_policy_phase
from untie.decision.settings import UntieConfig
from untie.decision.triggers import DivergenceTrigger, ScheduledTrigger, UntieWhen
from untie.distributed import broadcast_decision, resolve_tying_mode
from untie.errors import UntieRuntimeError, UntieValueError
from untie.registry import Registry
from untie.structure.facts import read_facts
from untie.structure.head_start import HeadVerdict
from untie.structure.peft_support import is_peft_model
from untie.structure.policy import PolicyChoice
from untie.structure.role_rates import RoleRates
from untie.structure.surgery import is_tied

logger = logging.getLogger(__name__)

#: The run state a checkpoint keeps (the "attributes" of `UntieRun.state_dict`, read back by `restore`).
SAVED_ATTRIBUTES = ("untied", "untie_step", "untie_reason", "trigger_state", "history", "policy", "plan", "lr_groups")


class UntieRun:
    """The state of one tie-then-untie run, and the execution of its decision (see the module docstring).

    Args:
        config: the run's settings (`untie.UntieConfig`).
        adapter: who drives the run (`untie.core.phases.Adapter`): messages name it; its calls are checked too.

    Attributes: `phase`; `facts` (read off the model); `saved` (the checkpoint's run; None: fresh, `PENDING`: not known
    yet); `decision`; `deadline` and `divergence` (its schedule); `untie_step` and `untie_reason` (the untie's one
    record); `pending_untie` (an untie due at the first forward of a resume); `pairs`; `measurements`; `structure` (of
    `model`); `rates` (per role); `plan` (the line it said); `said` (each warning once)."""

    def __init__(self, config: UntieConfig, adapter: Adapter = BY_HAND) -> None:
        self.config, self.adapter, self.owner = config, adapter, adapter.name
        self.phase: str = "new"
        self.facts: Facts | None = None
        self.saved: SavedFacts | object | None = None
        self.decision: Decision | None = None
        self.deadline = ScheduledTrigger(config.untie_at)
        self.divergence: DivergenceTrigger | None = None
        self.untie_step: int | None = None
        self.untie_reason: str | None = None
        self.pending_untie: int | None = None
        self.pairs: list[tuple[int, int]] = list(config.pairs) if isinstance(config.pairs, list) else []
        self.measurements = measuring.Measurements(config.metrics_every, adapter.name)
        self.model: nn.Module | None = None
        self.structure: ModelStructure | None = None
        self.attach_args: dict = {}  # the engine and the tokenizer it attached with (to attach a later model alike)
        self.optimizer, self.built_optimizer = None, None  # built: before attach (Untier(model, opt), Trainer(...))
        self.registry = Registry(adapter.name)
        self.plan: str | None = None
        self.begun: tuple[int, int | None] = (0, None)
        self.said: set[str] = set()
        self.rates = RoleRates.from_config(config, adapter.name, structure=lambda: self.structure)

    # -- what the run follows ------------------------------------------------------------------------------------------
    @property
    def untied(self) -> bool:
        return self.untie_step is not None

    @property
    def choice(self) -> PolicyChoice | None:
        """What the policy chose for the attached model, and why (`untie.structure.policy.PolicyChoice`)."""
        return self.decision.choice if self.decision is not None else None

    @property
    def rule(self) -> UntieWhen | None:
        return self.divergence.rule if self.divergence is not None else None

    def summary(self) -> lines.RunSummary:
        """Where the run stands, as plain values: what its lines are rendered from (`untie.decision.lines`)."""
        return lines.RunSummary(
            owner=self.owner,
            config=self.config,
            decision=self.decision,
            untie_at=self.deadline.untie_at,
            deadline_step=self.deadline.step,
            rule=self.rule,
            warmup_step=self.divergence.warmup_step if self.divergence is not None else 0,
            untie_step=self.untie_step,
            untie_reason=self.untie_reason,
            arrived_untied=self.facts is not None and self.facts.arrived_untied,
            pairs=bool(self.pairs),
            peft_split=self.facts.model.peft_split if self.facts is not None else (),
            emulated=self.structure is not None and self.structure.emulation is not None,
            measuring=self.measurements.probe is not None,
            rates=self.rates.line(),
        )

    @property
    def attached(self) -> ModelStructure:
        """The attached model's structure (phase 1 done)."""
        if self.structure is None:
            raise RunOrderError(f"{self.owner}: no model is attached yet (attach comes first).")
        return self.structure

    def check(self, call: str) -> None:
        """An adapter's call (a row of its `Adapter.transitions`) against the run's phase."""
        self.phase = enter(self.phase, call, self.adapter)

    def redecide(self, step: int = 0, optimizer=None) -> Decision:
        """Decide from what the run knows now (`decide`, the structure read again); say what is new; follow it."""
        assert self.facts is not None
        structure = self.attached
        self.facts = dataclasses.replace(self.facts, model=structure.facts(optimizer))
        emulated = structure.tying_mode == "emulated"
        settings = Settings(self.config, self.owner, self.adapter.tokenizer_hint, "emulated" if emulated else "live")
        decision = decide(self.facts, settings, self.saved, step)  # type: ignore[arg-type]
        if decision.refusal is not None:
            raise UntieValueError(decision.refusal)
        messages.say_once(self.said, decision.warnings)
        if self.decision is None or (decision.untie_at, decision.rule) != (self.deadline.untie_at, self.rule):
            self.deadline = ScheduledTrigger(decision.untie_at)
            self.divergence = DivergenceTrigger(decision.rule) if decision.rule else None
        if not decision.judge_first_batch:
            structure.drop_check()
        self.decision, self.rates.scales["input_embedding"] = decision, decision.embedding_lr_scale
        return decision

    def _execute(self, plan: StructurePlan, optimizer=None) -> None:
        assert self.decision is not None
        judge = self.take_head_verdict if self.decision.judge_first_batch else None
        self.attached.execute(plan, optimizer, draws=self.decision.head_init == "model", judge=judge)
        self.rates.place_head()

    # -- phase 1: attach -----------------------------------------------------------------------------------------------
    def attach(
        self, model: nn.Module, *, engine: str | None = None, tokenizer=None, optimizer=None, settle_later: bool = False
    ) -> None:
        """Phase 1, before the optimizer exists and the model is wrapped: read the model's facts (`read_facts`), decide,
        give the model its structure and the resume guard (with `optimizer` built, a structure it lacks is refused).
        Attaching again closes the previous attachment. `settle_later`: an untie before the first step waits."""
        expected = self.saved if self.phase == "expecting" and isinstance(self.saved, SavedFacts) else None
        attached = enter(self.phase, "attach", self.adapter)
        self._teardown()
        self.registry = Registry(self.adapter.name)
        self.model, self.optimizer, self.decision, self.built_optimizer = model, None, None, optimizer
        self.attach_args = {"engine": engine, "tokenizer": tokenizer}
        mode = resolve_tying_mode(self.config.tying_mode, engine)
        self.structure = ModelStructure(model, self.owner, self.registry, engine, mode)
        self.facts, self.pairs = read_facts(
            model,
            self.config,
            engine=engine,
            optimizer_built=optimizer is not None,
            tokenizer=tokenizer,
            listed=self.pairs,
            owner=self.owner,
            hint=self.adapter.tokenizer_hint,
        )
        self.saved = expected if expected is not None else (PENDING if settle_later else None)
        try:
            decision = self.redecide(optimizer=optimizer)
            if not self.facts.model.peft and not has_resume_guard(model):
                self.registry.hook("resume guard (load_state_dict pre-hook)", resume_guard_hook(model))
            self._execute(decision.start, optimizer)
        except BaseException:
            self.registry.close()  # a refused model keeps nothing of the run
            raise
        self.phase = attached
        if decision.waits:
            self.check("hold")
        if expected is not None:
            self.expect_checkpoint(expected)

    def settle(self, saved: SavedFacts | None) -> None:
        """The checkpoint, if any, is known (`saved`; None: a fresh start): decide again, and untie before the first
        step where the decision now says so. Before the optimizer exists."""
        self.check("settle")
        self.saved = saved
        decision = self.redecide(optimizer=self.built_optimizer)
        if decision.untied_from_start:
            self._execute(decision.start, self.built_optimizer)

    def adopt(self, other: UntieRun) -> None:
        """Take over what `other` attached (a callback Trainer re-created from a checkpoint's settings), emptied."""
        self.check("adopt")
        for name in ("model", "structure", "attach_args", "pairs", "facts", "saved", "said", "phase"):
            setattr(self, name, getattr(other, name))
        self.registry, other.registry, other.structure, other.phase = other.registry, Registry(), None, "closed"
        if self.structure is not None:
            if self.structure.first_batch is not None:
                self.structure.first_batch.on_verdict = self.take_head_verdict
            self.redecide()

    def expect_checkpoint(self, saved: SavedFacts, optimizer=None) -> None:
        """Give the model the structure of the checkpoint's run (`saved`) before its weights and the optimizer's
        state load: now, or at `attach` if no model is attached yet. With `optimizer` (a custom loop resuming after
        `start`), a head the untie adds joins it."""
        self.saved = saved
        if self.phase not in ("attached", "started"):
            self.check("expect")
            return
        self.check("expect_checkpoint")
        if is_peft_model(self.attached.model):
            return  # PEFT adapters hold no embedding; `attach` checked the model
        plan = self.redecide(optimizer=optimizer).resume
        assert plan is not None
        self._execute(plan, optimizer)

    def split_groups(self, optimizer, lr_scheduler=None, saved: SavedFacts | None = None) -> None:
        """The per-role param groups (`RoleRates.split`), as the resumed checkpoint (default: the known one) has."""
        saved = saved if saved is not None else self.saved if isinstance(self.saved, SavedFacts) else None
        provisional = ("input_embedding",) if self.choice is not None and self.choice.embedding_lr_scale else ()
        blocked = self.rates.split(optimizer, self.attached.model, self.registry, lr_scheduler, saved, provisional)
        if blocked and self.facts is not None:  # the policy's own scale cannot apply to this optimizer: a new fact
            self.facts = dataclasses.replace(self.facts, scale_blocked_by=blocked)
            self.redecide()

    def take_head_verdict(self, verdict: HeadVerdict) -> None:
        """The first batch's verdict on the drawn head: a new fact, decided on (the line and the run state say it)."""
        self.attached.first_batch = None
        if self.facts is not None:
            self.facts = dataclasses.replace(self.facts, first_batch=(verdict.start, verdict.detail))
            self.redecide()
        if verdict.start == "copy":
            logger.warning(lines.kept_copy_text(verdict.detail))

    # -- phase 2: start ------------------------------------------------------------------------------------------------
    def start(
        self, optimizer, step: int, max_steps: int | None, saved: dict | None = None, where: str = "the saved run state"
    ) -> dict | None:
        """Phase 2: begin training with `optimizer` at optimizer step `step` of `max_steps`, fresh (`saved` None) or
        resuming the run state `saved` (`state_dict`'s layout; checked: a damaged one raises `UntieStateError` naming
        `where`). Returns the checked state. A run may start again until its first step begins."""
        self.check("start")
        self.optimizer, self.begun = optimizer, (step, max_steps)
        checked = self.load_state_dict(saved, where, step) if saved else None
        if not saved:
            self.restore({}, step)
        self._begin(self.attached, optimizer, step, max_steps, resumed=bool(saved))
        return checked

    def _begin(self, structure: ModelStructure, optimizer, step: int, max_steps: int | None, resumed: bool) -> None:
        """Decide for the step and the state the run resumes; untie at a deadline already reached, else measure."""
        model, self.pending_untie = structure.model, None
        if (step or resumed) and not self.untied and (structure.emulation is not None or is_tied(model)):
            if not isinstance(self.saved, SavedFacts) or self.saved.untied is None:
                self.saved = SavedFacts(f"the state at step {step}", untied=False)  # it resumes its tied phase
        check_run_length(self.redecide(step), self.owner, max_steps)
        self.deadline.resolve(max_steps)
        if self.divergence is not None:
            self.divergence.resolve(max_steps)
        self.measurements.stop()
        emulation = structure.emulation
        if emulation is not None and self.untied:  # resumed after the untie: the head's values are its own
            emulation.release()
            structure.emulation = None
            return
        if emulation is not None:
            emulation.attach_optimizer(optimizer)
        elif not is_tied(model):
            # Untied before training: at step 0, or by the resume guard while loading an untied checkpoint.
            reason = self.untie_reason or structure.untie_reason or ("checkpoint" if step else "start")
            self._record_untie(self.untie_step if self.untie_step is not None else step, reason)
            return
        elif self.untied:
            raise UntieRuntimeError(lines.tied_model_for_untied_state(self.owner))
        if self.deadline.fires(step) and resumed and self.adapter.loads_after_start and emulation is None:
            # Its users load the optimizer state after `start`, into the tied structure it was saved from.
            self.pending_untie = step
            structure.before_first_forward(
                "untie (a deadline passed at the resume)", lambda: self.untie(step, "deadline")
            )
        elif self.deadline.fires(step):
            self.untie(step, "start" if step == 0 and self.deadline.untie_at == 0 else "deadline")
        elif self.config.metrics_every:
            self.measurements.watch(model, self.pairs, self.registry, emulation)

    # -- phase 3: the steps --------------------------------------------------------------------------------------------
    def arm(self, step: int) -> None:
        """Optimizer step `step` is about to run its first forward: measure its gradients if it is a metrics step."""
        self.check("arm")
        self.measurements.arm(step)

    def measure(self, step: int) -> None:
        """Optimizer step `step`'s gradients are complete (all micro-batches, all ranks): read the role signals off
        them and feed the trigger. Every rank must call it."""
        self._step_begins("measure")
        self.measurements.measure(step, self.pairs, self.divergence)

    def end_of_step(self, step: int) -> str | None:
        """Optimizer step `step` is done: untie if the trigger fired or the deadline is reached (returns why), or
        measure the drift of an untied model. Every rank must call it."""
        self._step_begins("end_of_step")
        if self.untied and self.measurements.measures(step):
            self.measurements.record(step, measuring.drift(self.attached.model, self.pairs, step))
        if self.untied:
            return None
        reason = None
        if self.divergence is not None and self.measurements.measures(step):  # every rank takes rank 0's decision
            reason = "trigger" if broadcast_decision(self.divergence.fired_step is not None) else None
        if reason is None and self.deadline.fires(step):
            reason = "deadline"
        if reason is not None:
            self.untie(step, reason)
        return reason

    def _step_begins(self, call: str) -> None:
        """The run's first step begins when it leaves "started": what the run does is said then, once."""
        begun = self.phase == "started"
        self.check(call)
        if begun:
            self.plan = messages.announce(self.summary(), self.said, *self.begun)

    def untie(self, step: int, reason: str) -> None:
        """Untie now, between optimizer steps, with the optimizer state of `config.optimizer_state`."""
        self.pending_untie = None
        self.measurements.stop()
        self.attached.untie(self.optimizer, self.config.optimizer_state)
        self.rates.place_head()
        self._record_untie(step, reason)
        logger.info(lines.untied_text(step, reason))

    def _record_untie(self, step: int, reason: str) -> None:
        if self.untie_step is None:
            self.untie_step, self.untie_reason = step, reason

    def take_latest(self) -> dict[str, float]:
        """The `untie/*` values to log now: the tying state and the last measurement (once)."""
        return {**self.measurements.take_latest(self.untie_step), **self.rates.current()}

    def close(self) -> None:
        """The run is over: take off every install; the model keeps the structure it was given. Idempotent."""
        messages.end_of_run(self.summary(), self.said, trained=self.phase in ("started", "stepping"))
        self._teardown()
        if self.phase not in ("new", "expecting"):
            self.check("close")

    def _teardown(self) -> None:
        self.measurements.stop()
        self.registry.close()
        self.pending_untie = None  # its hook came off with the registry
        if self.structure is not None:
            self.structure.first_batch = None

    # -- run state -----------------------------------------------------------------------------------------------------
    def state_dict(self, step: int, weights: dict | None = None) -> dict:
        """The run state at step `step`, JSON-able, in the layout both adapters save (`untie.checkpoints.saved_state`),
        with the weights' fingerprint (`weights`; None where the framework saves a folder as a whole)."""
        tying = self.structure.tying_mode if self.structure is not None else None
        config = checkpoint_config(self.config, self.decision).to_json_dict()
        return run_state(self.adapter.name, step, tying, config, self.state_attributes(), weights)

    def state_attributes(self) -> dict:
        """The run state a checkpoint keeps (`SAVED_ATTRIBUTES`), as JSON-able values."""
        trigger = self.divergence.state_dict() if self.divergence is not None else None  # average, streak, firing
        policy = self.choice.to_dict() if self.choice is not None else None
        values = (self.untied, self.untie_step, self.untie_reason, trigger, self.measurements.history, policy)
        return dict(zip(SAVED_ATTRIBUTES, (*values, self.plan, list(self.rates.groups)), strict=True))

    def load_state_dict(self, state: dict, where: str, step: int | None = None) -> dict:
        """Restore the run state `state_dict` saved (checked first: a damaged state raises `UntieStateError` naming
        `where`), as of step `step` (default: the saved step), and say which schedule settings changed."""
        state = check_state(state, where)
        self.config = resumed_config(self.config, state["config"])  # a setting left unset continues the checkpoint's
        self.rates.scales.update(input_embedding=self.config.embedding_lr_scale, head=self.config.head_lr_scale)
        step, attributes = state["global_step"] if step is None else step, state["attributes"]
        if not isinstance(self.saved, SavedFacts) and self.facts is not None:  # the state says how its run stood
            self.saved = SavedFacts(where, bool(attributes.get("untied")), policy_phase=saved_policy_phase(attributes))
            self.redecide(step)
        self.restore(attributes, step)
        messages.warn_changed_settings(self.summary(), state["config"], step)
        return state

    def restore(self, attributes: dict, step: int) -> None:
        """Start this run's state: a checkpoint's (`state_attributes`, saved at `step`) or fresh ({}, step 0). The
        trigger starts anew from the settings either way: a run object used for a second run carries nothing over."""
        self.measurements.restart(attributes.get("history", []), step)
        self.divergence = DivergenceTrigger(self.divergence.rule) if self.divergence is not None else None
        if self.divergence is not None and attributes.get("trigger_state"):
            self.divergence.load_state_dict(attributes["trigger_state"])
        kept = attributes if attributes.get("untied") else {}  # an untie's step and reason, where the run had untied
        self.untie_step, self.untie_reason = kept.get("untie_step"), kept.get("untie_reason")
