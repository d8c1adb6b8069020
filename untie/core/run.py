"""`UntieRun`: the run logic of a tie-then-untie training run, shared by every adapter.

One object holds what a run decides and remembers: the model's tied-phase structure (live or emulated tying), the
deadline and the divergence trigger, the role-gradient probe that feeds the trigger, the untie itself (optimizer
state, the gradient sync of a head created after DDP wrapped the model), the drift metrics after it, and the
history. It knows nothing of who drives the loop. The adapters translate their loop's events into its three phases:

1. `attach(model, engine=..., tokenizer=...)`: before the optimizer exists and the model is wrapped. The model's
   facts are read once; the tying mode, the pairs and the rule are fixed; the model gets its tied-phase structure and
   the resume guard. `expect_checkpoint(saved)` gives it the structure of a checkpoint about to load instead (before
   a model is attached, the run is "expecting" it). An adapter that learns of the checkpoint later (Trainer's
   `train()`) attaches with `settle_later`: the default's untie before the first step waits, "unsettled", for
   `settle(saved)`.
2. `start(optimizer, step, max_steps, saved=None)`: the optimizer exists; the run begins at `step`, fresh or from a
   saved run state (checked, restored, changed settings said). A run may start again before its first step (a custom
   loop resuming after a fresh start).
3. Per optimizer step `t` (counted from 1): `arm(t)` before its first forward, `measure(t)` once its gradients are
   complete, `end_of_step(t)` after the optimizer step (the untie happens here). What the run has to say about itself
   is said once, at its first step.

`close()` ends it: every install the run made (`registry`, `untie.registry.Registry`) comes off. The phases
("new", "expecting", "unsettled", "attached", "started", "stepping" once a step has ended, "closed") and the calls
each admits, the adapters' included, are one table, `CALL_PHASES`, checked in one place (`_enter`); a call out of
order raises `RunOrderError`, naming the order. What
the run says is `untie.core.messages`'; what it reads off the model besides the role gradients (the tokenizer's
pairs, the drift) is `untie.core.measuring`'s; the adapters show its state through one read-only view, `RunViews`.

* `untie.UntieCallback`: Trainer's events (`on_init_end`, `on_train_begin`, `on_pre_optimizer_step`, ...);
* `untie.Untier`: a custom PyTorch or accelerate loop (`Untier()`, `start`, one `step()` per optimizer step).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Literal

from torch import nn

from untie import _compat
from untie.checkpoints.checkpoint import has_resume_guard, resume_guard_hook
from untie.checkpoints.saved_state import STATE_FORMAT, check_state
from untie.config import UntieConfig
from untie.core import measuring, messages
from untie.distributed import (
    broadcast_decision,
    is_sharded,
    is_split,
    resolve_tying_mode,
    sync_grads_across_ranks,
    world_size,
)
from untie.engines import TiedPhase, tied_phase_for
from untie.errors import UntieError, UntieRuntimeError, UntieValueError
from untie.registry import Registry
from untie.signals.metrics import role_signals_on_rows, summarize_pair_metrics
from untie.signals.pairs import is_tokenizer
from untie.signals.probe import RoleGradientProbe
from untie.signals.triggers import DivergenceTrigger, ScheduledTrigger, UntieWhen, default_rule, pair_signal
from untie.structure.head_start import FirstBatchCheck, HeadVerdict
from untie.structure.peft_support import check_peft_run, is_peft_model
from untie.structure.plan import ModelFacts, RunSettings, SavedFacts, Structure, StructurePlan, plan_structure
from untie.structure.policy import PolicyChoice, choose_plan, settle
from untie.structure.surgery import (
    add_param_like,
    draw_head,
    drop_param,
    inner_optimizer,
    input_weight,
    is_tied,
    output_weight,
    tie_embeddings,
    untie_embeddings,
    untie_recorded,
    was_untied,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Adapter:
    """What an adapter tells the run about itself: the name users wrote (warnings and errors name it) and how a
    tokenizer reaches it (for ``pairs="auto"``). The run's behaviour does not depend on it."""

    name: str
    tokenizer_hint: str


#: The Trainer callback (`untie.UntieCallback`) and the custom-loop adapter (`untie.Untier`).
TRAINER_CALLBACK = Adapter("UntieCallback", "Trainer(processing_class=tokenizer)")
CUSTOM_LOOP = Adapter("Untier", "tokenizer=tokenizer")

Phase = Literal["new", "expecting", "unsettled", "attached", "started", "stepping", "closed"]

#: Each call of the run and the phases it may come in: the one place the order of a run's calls is checked
#: (`UntieRun._enter`), the adapters' calls included. "expecting": a checkpoint's structure is known before a model is
#: attached (`expect_checkpoint` first; `attach` applies it); "unsettled": attached, the plan's untie before the first
#: step held back until `settle` knows the checkpoint (Trainer's `train()`); "started": `start` ran and no step has
#: ended (a custom loop may start again, resuming after a fresh start); "stepping": a step has ended.
CALL_PHASES: dict[str, frozenset[str]] = {
    "expect_checkpoint": frozenset({"new", "expecting", "closed", "attached", "started"}),
    "attach": frozenset({"new", "expecting", "unsettled", "attached", "closed"}),
    "settle": frozenset({"unsettled"}),
    "adopt": frozenset({"new"}),
    "start": frozenset({"attached", "started"}),
    "arm": frozenset({"started", "stepping"}),
    "measure": frozenset({"started", "stepping"}),
    "end_of_step": frozenset({"started", "stepping"}),
    # Trainer's start of training (`untie.UntieCallback`): the callback attached when the Trainer was built.
    "UntieCallback.on_train_begin": frozenset({"attached"}),
    # The custom loop's calls (`untie.Untier`): start once, steps after it, a state loaded after start and before the
    # first step.
    "Untier.start": frozenset({"attached"}),
    "Untier.step": frozenset({"started", "stepping"}),
    "Untier.load_state_dict": frozenset({"started"}),
}

#: The order each adapter's users follow, named by a call out of order (by the call's prefix; the run's own calls last).
CALL_ORDERS: dict[str, str] = {
    "Untier.": "Untier(model) before the optimizer, untier.start(optimizer) once, untier.load_state_dict(...) or "
    "accelerator.load_state(...) before the first step, untier.step() after each optimizer step, then untier.close()",
    "UntieCallback.": "UntieCallback prepares the model when the Trainer is built, before the optimizer and the "
    "checkpoint loader see it (trainer.add_callback(...) afterwards is too late). Pass it to the constructor: "
    "Trainer(..., callbacks=[UntieCallback(...)])",
    "": "attach (before the optimizer), start (with the optimizer), then the steps, then close",
}


class RunOrderError(UntieError, RuntimeError):
    """A run's calls came out of order (see `untie.core.run`): e.g. a step before `start`."""


#: The run state a checkpoint keeps (the "attributes" of `UntieRun.state_dict`, read back by `restore`).
SAVED_ATTRIBUTES = ("untied", "untie_step", "untie_reason", "trigger_state", "history", "policy", "plan")


class UntieRun:
    """The state and decisions of one tie-then-untie run, driven by an adapter (see the module docstring).

    Args:
        config: the run's settings (`untie.UntieConfig`).
        adapter: who drives the run (`TRAINER_CALLBACK`, `CUSTOM_LOOP`): messages name it.
    """

    def __init__(self, config: UntieConfig, adapter: Adapter = TRAINER_CALLBACK) -> None:
        self.config = config
        self.adapter = adapter
        self.owner = adapter.name
        self.choice: PolicyChoice | None = None
        """What `config.policy` chose for the attached model (`untie.structure.policy`), at `attach`."""
        self.use_schedule(config.untie_at, config.rule(with_pairs=config.pairs != []))
        self.untie_step: int | None = None
        """The optimizer step of the untie (None while tied): `untied` is derived from it."""
        self.untie_reason: str | None = None
        """Why the model was untied: "trigger" (divergence), "deadline" (untie_at) or "checkpoint"/"start"."""
        self.pairs: list[tuple[int, int]] = list(config.pairs) if isinstance(config.pairs, list) else []
        """The measured pairs: `config.pairs`, or those read from the tokenizer (`read_pairs`)."""
        self.history: list[dict[str, float]] = []
        """Every measurement: {"step": ..., signal: value, ...}; the smoothed trigger signal as "trigger"."""
        self.tying_mode: str | None = None
        """The tied phase's implementation, "live" or "emulated" (`use_tying_mode`)."""
        self.engine: str | None = None
        """The engine that trains (`untie.distributed.training_engine`): "FSDP2", "DEEPSPEED" or None."""
        self.emulation: TiedPhase | None = None
        self.latest: dict[str, float] = {}
        """The last measurement, summarised for logging (`untie/<key>`); cleared by `take_latest`."""
        self.probe: RoleGradientProbe | None = None
        self.planned_untie_reason: str | None = None
        """Why the structure plan untied the model before training ("start", "checkpoint"), for `begin`."""
        self._grad_sync_installed = False
        self._unmeasured_warned = False
        self.no_pairs_because: str | None = None
        """Why `read_pairs` found no pairs, for the default rule's warning (None: it found some, or never read)."""
        self._rule_change_said = False
        self.model: nn.Module | None = None
        """The attached model (unwrapped)."""
        self.attach_args: dict = {}
        """The engine and the tokenizer the run attached with (to attach a later model the same way)."""
        self.optimizer = None
        """The optimizer `start` was given."""
        self.registry = Registry(adapter.name)
        """Every install of this run (hooks, wrappers, guards, replaced forwards), each with its removal: `close()`."""
        self.phase: Phase = "new"
        """Where the run stands (`CALL_PHASES`): "new", "expecting", "unsettled", "attached" (phase 1 done),
        "started" (phase 2: steps may run), "stepping", "closed"."""
        self._announce_pending = False
        self.expected: SavedFacts | None = None
        """The checkpoint's structure `attach` applies (phase "expecting": `expect_checkpoint` before a model)."""
        self.arrived_untied = False
        """The attached model came untied (its head a matrix of its own, trained or reloaded)."""
        self.plan: str | None = None
        """What the run said at train begin it would do (`untie.core.messages.plan_line`), kept in the run state."""
        self.first_batch: FirstBatchCheck | None = None
        """The check that keeps or replaces the default's drawn head at the first forward
        (`untie.structure.head_start`); None where no head was drawn by default, once it has decided, or where the run
        resumed."""

    @property
    def untied(self) -> bool:
        """Whether the model has been untied: derived from `untie_step`, the one record of the untie."""
        return self.untie_step is not None

    @property
    def untie_at(self) -> int | float | None:
        """`untie_at` as the run follows it (the deadline's): the config's, or 0 where the policy trains untied from
        the start."""
        return self.deadline.untie_at

    @property
    def rule(self) -> UntieWhen | None:
        """The divergence trigger's rule (`untie.UntieWhen`), "divergence" resolved (`match_rule_to_pairs`); None
        without a trigger."""
        return self.divergence.rule if self.divergence is not None else None

    def use_schedule(self, untie_at: int | float | None, rule: UntieWhen | None) -> None:
        """The schedule the run follows: `untie_at` and the trigger's `rule` as set, or as the policy chose. The
        deadline and the trigger hold them (`untie_at`, `rule` read them)."""
        self.deadline = ScheduledTrigger(untie_at)
        """`untie_at`: the divergence trigger's deadline, or the fixed schedule when there is no trigger."""
        self.divergence: DivergenceTrigger | None = DivergenceTrigger(rule) if rule else None

    def apply_policy(self, model: nn.Module, settle_later: bool = False) -> bool:
        """Let `config.policy` choose the schedule for `model` (`untie.structure.policy.choose_plan`), before its
        structure is planned: "untied from the start" is ``untie_at=0`` without a trigger. A checkpoint already
        expected (`expect_checkpoint` before attach) decides with it (`untie.structure.policy.settle`);
        `settle_later`: the adapter learns later whether a checkpoint loads (Trainer's `train()`), so an untie
        before the first step waits for `settle`. Returns whether it waits (the run is then "unsettled")."""
        policy, why = self.config.chosen_policy()
        if policy == "auto":
            _compat.warn_in_user_code(
                f"{self.owner}(policy='auto'): 'auto' is retired (its held-out validation failed, docs/recipes/"
                "decision-map.md). Leave policy unset for the default ('fresh-untied'), or pass policy='off'.",
                FutureWarning,
            )
        choice = choose_plan(
            policy,
            model,
            tied=is_tied(model) and not was_untied(model),
            peft=is_peft_model(model),
            from_scratch=self.config.from_scratch,
        )
        if why and policy == "off":  # the schedule was set: that is the whole reason
            self.choice = dataclasses.replace(choice, reason=why)
        else:
            self.choice = dataclasses.replace(choice, reason=f"{choice.reason} ({why})") if why else choice
        if choice.warning is not None:
            _compat.warn_in_user_code(f"{self.owner}: {choice.warning}")
        unused = messages.unused_setting(self.config, self.choice, self.owner)
        if unused is not None:
            _compat.warn_in_user_code(unused)
        if settle_later and self.expected is None and self.choice.untied_from_start:
            return True
        self.choice = settle(self.choice, self.expected)
        self.follow_choice()
        return False

    def settle(self, saved: SavedFacts | None) -> None:
        """Decide the plan once the checkpoint, if any, is known (`saved`; None: a fresh start): an untie before the
        first step that `attach(settle_later=True)` held back happens now, unless the checkpoint's run was still tied
        (`untie.structure.policy.settle`). Before the optimizer exists; in phase "unsettled" only."""
        self._enter("settle")
        self.phase = "attached"
        assert self.choice is not None
        self.choice = settle(self.choice, saved)
        self.follow_choice()
        if self.choice.untied_from_start:
            model = self.attached_model
            facts = model_facts(model, emulating=self.emulation is not None)
            self.apply_plan(model, plan_structure(facts, self.settings()), facts=facts)

    def follow_choice(self) -> None:
        """Follow the policy's choice: "untied from the start" is ``untie_at=0`` without a trigger; "as set" keeps
        the schedule `use_schedule` was given."""
        if self.choice is not None and self.choice.untied_from_start:
            self.use_schedule(0, None)

    # -- phase 1: attach -----------------------------------------------------------------------------------------------
    def attach(
        self, model: nn.Module, *, engine: str | None = None, tokenizer=None, optimizer=None, settle_later: bool = False
    ) -> None:
        """Phase 1, before the optimizer exists and the model is wrapped: read the model's facts, fix the tying mode
        (`engine`: `untie.distributed.training_engine`), the pairs (from `tokenizer` when asked) and the rule,
        and give the model its tied-phase structure and the resume guard. With `optimizer` already built, a structure
        it was built without is refused. Attaching again (a new model for a new `train()` call) closes the previous
        attachment first. `settle_later`: an untie before the first step waits for `settle` (the checkpoint, if any,
        is not known yet)."""
        self._enter("attach")
        expecting = self.phase == "expecting"
        self.close()
        self.registry = Registry(self.adapter.name)
        self.model = model
        self.arrived_untied = not is_tied(model) and not is_peft_model(model)
        self.attach_args = {"engine": engine, "tokenizer": tokenizer}
        self.use_schedule(self.config.untie_at, self.config.rule(with_pairs=self.config.pairs != []))
        unsettled = self.apply_policy(model, settle_later)
        self.use_tying_mode(engine)
        asked = self.config.pairs == "auto"
        if asked or (self.config.pairs is None and is_tokenizer(tokenizer)):
            self.pairs, self.no_pairs_because = measuring.read_pairs(
                tokenizer, model, asked=asked, owner=self.owner, hint=self._tokenizer_hint
            )
        self.match_rule_to_pairs()
        try:
            self.prepare(model, optimizer)
        except BaseException:
            self.registry.close()  # a refused model keeps nothing of the run
            raise
        self.phase = "unsettled" if unsettled else "attached"
        if expecting and self.expected is not None:
            self.expect_checkpoint(self.expected)

    def adopt(self, other: UntieRun) -> None:
        """Take over what `other` attached (a callback Trainer re-created from a checkpoint's settings: the model,
        its structure, the tying and every install); `other` is left empty."""
        self._enter("adopt")
        attached = (
            "model",
            "attach_args",
            "tying_mode",
            "engine",
            "emulation",
            "pairs",
            "no_pairs_because",
            "choice",
            "arrived_untied",
            "phase",
            "first_batch",
        )
        for name in (*attached, "registry", "planned_untie_reason"):
            setattr(self, name, getattr(other, name))
        if self.first_batch is not None:
            self.first_batch.on_verdict = self.take_head_verdict
        other.registry, other.emulation, other.phase = Registry(other.adapter.name), None, "closed"
        other.first_batch = None
        self.match_rule_to_pairs()  # "divergence" follows the pairs found then
        self.follow_choice()

    def expect_checkpoint(self, saved: SavedFacts, optimizer=None) -> None:
        """Give the model the structure of the checkpoint's run (`saved`) before its weights and the optimizer's
        state load, so that they fit the same structure: now, or at `attach` if no model is attached yet (a model
        Trainer builds with model_init: phase "expecting"). With `optimizer` (a custom loop resuming after `start`), a
        head the untie adds joins it."""
        self._enter("expect_checkpoint")
        self.expected = saved
        if self.phase not in ("attached", "started"):
            self.phase = "expecting"
            return
        self.expected = None
        if is_peft_model(self.attached_model):
            return  # PEFT adapters hold no embedding; `prepare` checked the model
        self.match_saved(self.attached_model, saved, optimizer)

    # -- phase 2: start ------------------------------------------------------------------------------------------------
    def start(
        self,
        optimizer,
        step: int,
        max_steps: int | None,
        saved: dict | None = None,
        where: str = "the saved run state",
    ) -> dict | None:
        """Phase 2: begin training with `optimizer` at optimizer step `step` of `max_steps`, fresh (`saved` None)
        or resuming the run state `saved` (`state_dict`'s layout; checked, a damaged one raises
        `untie.checkpoints.saved_state.UntieStateError` naming `where`). Untie at a deadline already reached, else
        set up the measurements. Returns the checked state. A run may start again until its first step ends."""
        self._enter("start")
        self.optimizer = optimizer
        checked = None
        if saved:
            checked = self.load_state_dict(saved, where, step)
        else:
            self.restore({}, step)
        self.begin(self.attached_model, optimizer, step, max_steps, resumed=bool(saved))
        self.phase, self._announce_pending = "started", True
        self._started = (step, max_steps)
        return checked

    @property
    def attached_model(self) -> nn.Module:
        """The attached model (phase 1 done)."""
        if self.model is None:
            raise RunOrderError(f"{self.owner}: no model is attached yet (attach comes first).")
        return self.model

    def _enter(self, call: str) -> None:
        """The one check of the calls' order (`CALL_PHASES`; see the module docstring), for the run's calls and the
        adapters' (`check`)."""
        phases = CALL_PHASES[call]
        if self.phase not in phases:
            after = " (the run has taken steps; it cannot start again)" if self.phase == "stepping" else ""
            order = next(text for prefix, text in CALL_ORDERS.items() if call.startswith(prefix))
            raise RunOrderError(
                f"{self.owner}: {call}() in phase {self.phase!r}{after} (it needs {' or '.join(sorted(phases))}). The "
                f"order is {order}."
            )

    def check(self, call: str, model: nn.Module | None = None) -> None:
        """An adapter's call (a key of `CALL_PHASES`, e.g. "Untier.step") is checked against the run's phase here,
        with the run's own calls: a call out of order raises `RunOrderError`, naming the order. With `model` (the
        model the adapter is about to train), a model other than the attached one is refused the same way: the run
        never prepared it (no tied-phase structure, no resume guard)."""
        self._enter(call)
        if model is not None and model is not self.model:
            raise RunOrderError(
                f"{self.owner}: {call}() got a model the run did not prepare (was trainer.model replaced after the "
                "Trainer was built?): its tied structure and checkpoint guard would be missing. Build a new Trainer "
                "with that model, or give Trainer a model_init that returns it."
            )

    def _announce_once(self) -> None:
        if self._announce_pending:
            self._announce_pending = False
            self.announce(*self._started)

    # -- before the optimizer exists -----------------------------------------------------------------------------------
    @property
    def _tokenizer_hint(self) -> str:
        return self.adapter.tokenizer_hint

    def match_rule_to_pairs(self) -> None:
        """With pairs=None, "divergence" is the evidence rule only if the tokenizer gave pairs: else the pair-free
        rule. A per-pair rule the user chose, with no pairs to read, is refused."""
        rule = self.rule
        if rule is None or self.pairs or pair_signal(rule.signal) is None:
            return
        if self.config.is_default_rule:
            self.divergence = DivergenceTrigger(default_rule(with_pairs=False))
            if self.config.pairs is not None or self._rule_change_said:
                return  # pairs=[] is the user's choice; pairs="auto" has warned already
            if self.choice is not None and self.choice.untied_from_start:
                return  # no trigger runs (the untie before the first step waits for `settle`): nothing to announce
            self._rule_change_said = True
            logger.warning(
                "untie: the default trigger reads no pairs: %s. It uses the pair-free rule (untie_when='cancellation') "
                "instead of the evidence rule. To measure pairs, pass the tokenizer (%s) or pairs=[(id_a, id_b), ...]; "
                "untie_when='cancellation' chooses this rule and silences this message.",
                self.no_pairs_because or "no tokenizer was given",
                self._tokenizer_hint,
            )
            return
        raise UntieValueError(
            f"untie_when.signal={rule.signal!r} reads pairs, and there are none: no tokenizer to read them from "
            f"({self._tokenizer_hint}) or its vocabulary has no case or word-start variants. Pass pairs=[(id_a, "
            "id_b), ...], or a pair-free rule (untie_when='cancellation')."
        )

    def use_tying_mode(self, engine: str | None) -> None:
        """Resolve `config.tying_mode` for the engine that trains (`untie.distributed.training_engine`)."""
        self.tying_mode = resolve_tying_mode(self.config.tying_mode, engine)
        self.engine = engine

    def settings(self) -> RunSettings:
        """The settings `plan_structure` decides from (the tying mode resolved by `use_tying_mode`)."""
        config = self.config
        mode: Literal["live", "emulated"] = (
            "emulated" if (self.tying_mode or config.tying_mode) == "emulated" else "live"
        )
        by_default = self.choice is not None and self.choice.untied_from_start and config.policy is None
        return RunSettings(self.owner, self.untie_at, mode, config.tying_mode, config.tie_init, by_default)

    def prepare(self, model: nn.Module, optimizer=None) -> None:
        """Give the model its tied-phase structure, before the optimizer exists and the model is wrapped (with an
        `optimizer` already built, refuse a structure it was built without)."""
        self.emulation = None
        facts = model_facts(model, optimizer_built=optimizer is not None)
        if not facts.peft and not has_resume_guard(model):
            self.registry.hook("resume guard (load_state_dict pre-hook)", resume_guard_hook(model))
        self.apply_plan(model, plan_structure(facts, self.settings()), facts=facts)

    def match_saved(self, model: nn.Module, saved: SavedFacts, optimizer=None) -> None:
        """Give the model the structure of the checkpoint's run (`saved`), before its weights and the optimizer's
        state load, so that they fit the same structure. With `optimizer` (a custom loop resuming after `start`),
        a head the untie adds joins it."""
        facts = model_facts(model, emulating=self.emulation is not None, optimizer_built=optimizer is not None)
        self.apply_plan(model, plan_structure(facts, self.settings(), saved), optimizer, facts=facts)

    def apply_plan(
        self, model: nn.Module, plan: StructurePlan, optimizer=None, facts: ModelFacts | None = None
    ) -> None:
        """Carry out `plan` (`untie.structure.plan.plan_structure`) on the model, and on the optimizer if it exists.
        `facts`: what the plan was made from (`model_facts`), not read again."""
        if plan.refusal is not None:
            raise (RunOrderError if plan.call_order else UntieValueError)(plan.refusal)
        facts = facts or model_facts(model, emulating=self.emulation is not None)
        if plan.check_peft:
            # PEFT owns the embedding and the head: only a base model untied before wrapping can train here.
            tied = facts.structure == "tied"
            check_peft_run(model, tied=tied, untie_recorded=facts.config_says_untied, keep_untied=plan.keep_untied)
            return
        if plan.warning is not None:
            _compat.warn_in_user_code(plan.warning)
        if plan.untie_reason is not None:
            self.planned_untie_reason = plan.untie_reason
        current = facts.structure
        if plan.target == "untied":
            self._reach_untied(model, current, optimizer)
        elif plan.target == "tied" and current == "untied":
            if plan.drop_head and optimizer is not None:
                drop_param(optimizer, output_weight(model))
            tie_embeddings(model, init=plan.tie_init)
        elif plan.target == "emulated" and current != "emulated":
            if current == "untied":
                tie_embeddings(model, init=plan.tie_init)  # the other matrix is dropped, as for a live tied phase
            untie_embeddings(model)  # the head gets its own parameter now, before wrapping, and trains as if tied
            if self.tying_mode == "live":
                logger.info("untie: the checkpoint was written with emulated tying; this run resumes it emulated.")
            self.tying_mode = "emulated"
            # One implementation per engine (ZeRO reduces and partitions gradients in backward: it ties in autograd).
            self.emulation = tied_phase_for(self.engine, model, self.registry)

    def head_init(self) -> str:
        """How a head untied before the first step starts: `config.head_init`, "auto" following the policy."""
        if self.config.head_init != "auto":
            return self.config.head_init
        if self.choice is not None and self.choice.untied_from_start:
            return self.choice.head_init
        return "model" if self.config.from_scratch is True else "copy"  # your word: built fresh (untie_at=0 set)

    def _reach_untied(self, model: nn.Module, current: str, optimizer) -> None:
        if current == "emulated":  # the head has had its own parameter, in the optimizer, from the start
            assert self.emulation is not None
            self.emulation.release()
            self.emulation = None
            if optimizer is None and self.head_init() == "model":
                draw_head(model, self.owner)  # an untie held back until `settle`, before sharding
                self.check_first_batch(model)
        elif current == "tied" or optimizer is None:
            # On an untied model (a reloaded untie, untie_at=0) this re-applies the bookkeeping a reload loses. A
            # resumed run's head gets its optimizer state from the checkpoint, loaded next.
            untie_embeddings(model, optimizer, optimizer_state="reset")
            if current == "tied" and self.head_init() == "model":
                draw_head(model, self.owner)  # a resumed run's head is then loaded from its checkpoint
                self.check_first_batch(model)
            if optimizer is not None:
                self.install_grad_sync(model)
        else:  # untied before this resume (untie_at=0, or the model's state dict loaded first): the head must train
            head, embedding = output_weight(model), input_weight(model)
            if not any(p is head for group in inner_optimizer(optimizer).param_groups for p in group["params"]):
                add_param_like(optimizer, new=head, like=embedding, state="reset")
                self.install_grad_sync(model)

    def check_first_batch(self, model: nn.Module) -> None:
        """The default's drawn head is provisional: the first forward keeps it only where the model predicts no better
        with a copy of its embedding (`untie.structure.head_start`), so that no trained weights the embedding alone
        misread as fresh are drawn over. An explicit ``head_init="model"`` draws as asked. Sharded heads (FSDP2,
        DeepSpeed) are drawn before sharding and cannot be replaced in the first forward: there the weights'
        evidence decides alone (docs/guides/trainer.md)."""
        if self.config.head_init != "auto" or self.config.from_scratch is True:
            return  # drawn as asked: head_init="model", or your word that the model is built fresh
        if self.engine is not None or is_split(output_weight(model)):
            return
        if self.first_batch is not None:
            self.first_batch.remove()
        self.first_batch = FirstBatchCheck(model, self.take_head_verdict, self.registry)

    def take_head_verdict(self, verdict: HeadVerdict) -> None:
        """The first batch's verdict on the drawn head (`FirstBatchCheck`): the choice records the head's start and
        why, for the line at train begin and the run state."""
        self.first_batch = None
        if self.choice is not None:
            if verdict.start == "copy":  # the weights' evidence was wrong: the function says what the model is
                reason = f"at the first batch, {verdict.detail} (its embedding alone had read as a fresh draw)"
            else:
                reason = f"{self.choice.reason}; at the first batch, {verdict.detail}"
            self.choice = dataclasses.replace(self.choice, head_init=verdict.start, reason=reason)
        if verdict.start == "copy":
            logger.warning("untie: the head starts as a copy of the embedding, not drawn: %s", verdict.detail)

    # -- run state -----------------------------------------------------------------------------------------------------
    @property
    def trigger_state(self) -> dict | None:
        """The divergence trigger's running state (average, streak, firing step); None without a trigger."""
        return self.divergence.state_dict() if self.divergence is not None else None

    @trigger_state.setter
    def trigger_state(self, value: dict | None) -> None:
        if self.divergence is not None and value:
            self.divergence.load_state_dict(value)

    def state_dict(self, step: int, weights: dict | None = None) -> dict:
        """The run state at optimizer step `step`, JSON-able, in the one layout both adapters save
        (`untie.checkpoints.saved_state`): the settings, the tied phase's implementation, the untie and the trigger,
        the history,
        and the weights' fingerprint (`weights`, None where the adapter's framework saves a folder as a whole)."""
        return {
            "format": STATE_FORMAT,
            "adapter": self.adapter.name,
            "global_step": step,
            "tying_mode": self.tying_mode,
            "config": self.config.to_json_dict(),
            "attributes": self.state_attributes(),
            "weights": weights,
        }

    def load_state_dict(self, state: dict, where: str, step: int | None = None) -> dict:
        """Restore the run state `state_dict` saved (checked first: a damaged state raises
        `untie.checkpoints.saved_state.UntieStateError` naming `where`), as of optimizer step `step` (default: the
        saved step),
        and say which schedule settings changed. Returns the checked state. The model's structure is the plan's
        (`match_saved`), applied before the weights load."""
        state = check_state(state, where)
        step = state["global_step"] if step is None else step
        self.restore(state["attributes"], step)
        changed = messages.changed_settings(self, state["config"], step)
        if changed is not None:
            _compat.warn_in_user_code(changed)
        return state

    def state_attributes(self) -> dict:
        """The run state a checkpoint keeps, as JSON-able values (read back by `restore`; the policy's choice is a
        record of what the run chose, made again from the model at `attach`)."""
        attributes = {name: getattr(self, name) for name in SAVED_ATTRIBUTES if name not in ("policy", "plan")}
        attributes["policy"] = self.choice.to_dict() if self.choice is not None else None
        attributes["plan"] = self.plan
        return attributes

    def restore(self, attributes: dict, step: int) -> None:
        """Start this run's state: a checkpoint's (`state_attributes`, saved at `step`) or fresh ({}, step 0).

        The trigger starts anew from the settings either way, so a run object used for a second run (Trainer's
        train() called again) carries nothing over.
        """
        self.history = [h for h in attributes.get("history", []) if h["step"] <= step]
        self.divergence = DivergenceTrigger(self.divergence.rule) if self.divergence is not None else None
        self.trigger_state = attributes.get("trigger_state")
        untied = bool(attributes.get("untied"))
        self.untie_step = attributes.get("untie_step") if untied else None
        self.untie_reason = attributes.get("untie_reason") if untied else None
        self.latest, self._unmeasured_warned = {}, False

    # -- the run -------------------------------------------------------------------------------------------------------
    def begin(self, model: nn.Module, optimizer, step: int, max_steps: int | None, resumed: bool = False) -> None:
        """Start training at optimizer step `step` of `max_steps`: untie at a deadline already reached, else set up
        the measurements. The model is prepared and any checkpoint is loaded (`resumed`: a saved run state, which may
        be a tied one saved at step 0: its run continues as it was). It says nothing: `announce` does, once
        the adapter knows which run begins (`Untier` begins a fresh run at `start` and, when a checkpoint loads before
        the first step, the resumed one in its place)."""
        if self.first_batch is not None and (step or (resumed and is_tied(model))):
            # A resumed run's head is its checkpoint's, trained, or the run resumes tied: nothing to judge. A state
            # saved at step 0 holds the draw the first forward has not judged yet: the check stays.
            self.first_batch.remove()
            self.first_batch = None
        if (step or resumed) and self.choice is not None and self.choice.untied_from_start and not self.untied:
            if self.emulation is not None or is_tied(model):
                self.keep_resumed_tied_phase(step)
        self.deadline.resolve(max_steps)
        if self.divergence is not None:
            self.divergence.resolve(max_steps)
        self.drop_probe()
        if self.emulation is not None:
            self._begin_emulated(model, optimizer, step, max_steps)
            return
        if not is_tied(model):
            # Untied before training: at step 0, or by the resume guard while loading an untied checkpoint.
            reason = self.untie_reason or self.planned_untie_reason or ("checkpoint" if step else "start")
            self._record_untie(self.untie_step if self.untie_step is not None else step, reason)
        elif self.untied:
            raise UntieRuntimeError(
                f"{self.owner}: the checkpoint state says the model was untied, but the model is tied. Resume with "
                "the same model class, or call untie.prepare_for_resume(model, checkpoint_dir) before loading it."
            )
        elif self.deadline.fires(step):
            self.untie(model, optimizer, step, "deadline")
        elif self.config.metrics_every:
            self.probe = RoleGradientProbe(model, pairs=self.pairs, registry=self.registry)

    def keep_resumed_tied_phase(self, step: int) -> None:
        """A checkpoint's run was still tied at `step` but the run untied before it was known (a custom loop's state
        loaded after `start`): the checkpoint decides (`untie.structure.policy.settle`), as at `settle`. The run
        continues its tied phase under untie_at / untie_when, as its checkpoint's run was doing."""
        assert self.choice is not None
        self.choice = settle(self.choice, SavedFacts(f"the state at step {step}", untied=False))
        self.use_schedule(self.config.untie_at, self.config.rule(with_pairs=bool(self.pairs)))
        self.match_rule_to_pairs()

    def _begin_emulated(self, model: nn.Module, optimizer, step: int, max_steps: int | None) -> None:
        emulation = self.emulation
        assert emulation is not None
        if self.untied:  # resumed from a checkpoint saved after the untie: the head's values and state are its own
            emulation.release()
            self.emulation = None
            return
        emulation.attach_optimizer(optimizer)
        if self.deadline.fires(step):
            self.untie(model, optimizer, step, "deadline")
        elif self.config.metrics_every:
            # A measurement costs O(|T| d) per rank (the rows the batch looked up), also sharded: the trigger stays on.
            self.probe = RoleGradientProbe(model, pairs=self.pairs, emulation=self.emulation, registry=self.registry)

    def announce(self, step: int, max_steps: int | None) -> None:
        """Say what the run that `begin` set up at `step` will do, in one line and in its own numbers
        (`untie.core.messages.plan_line`, kept in the run state; a warning where a policy decided, a note where the
        schedule was set), and what the user should know before its first step runs (a trigger that cannot fire in
        the run's length). Call it once per begun run, after the last `begin`."""
        self.plan = messages.plan_line(self, step, max_steps)
        # A warning where a policy decided (what the user did not spell out); a schedule set by hand is only noted.
        decided = self.choice is not None and self.choice.policy != "off"
        logger.log(logging.WARNING if decided else logging.INFO, self.plan)
        if self.probe is not None:
            messages.short_run_notice(self, step, max_steps)

    def arm(self, step: int) -> None:
        """Optimizer step `step` is about to run its first forward: measure its gradients if it is a metrics step."""
        self._enter("arm")
        if self.probe is not None:
            self.probe.armed = self.measures(step)

    def measure(self, step: int) -> None:
        """Optimizer step `step`'s gradients are complete (all micro-batches, all ranks): read the role signals off
        them and feed the trigger. Every rank must call it."""
        self._enter("measure")
        self._announce_once()
        if self.probe is None or not self.probe.armed:
            return
        self.probe.armed = False
        grads = self.probe.collect()
        if grads is None:
            if not self._unmeasured_warned:
                self._unmeasured_warned = True
                _compat.warn_in_user_code(messages.unmeasured(self.owner))
            return
        signals = role_signals_on_rows(grads, pairs=self.pairs)
        signals.update(self.probe.pair_measurements(grads))
        if self.divergence is not None:
            self.divergence.update(step, signals)
            signals["trigger"] = self.divergence.average if self.divergence.average is not None else math.nan
        self._record(step, signals)

    def end_of_step(self, step: int) -> str | None:
        """Optimizer step `step` is done: untie if the trigger fired or the deadline is reached (returns why), or
        measure the drift of an untied model. Every rank must call it."""
        self._enter("end_of_step")
        self._announce_once()
        self.phase = "stepping"
        model, optimizer = self.attached_model, self.optimizer
        if self.untied:
            if self.measures(step):
                self._record(step, measuring.drift(model, self.pairs, step))
            return None
        reason = None
        if self.divergence is not None and self.measures(step):
            # Every rank takes rank 0's decision, at the same step.
            if broadcast_decision(self.divergence.fired_step is not None):
                reason = "trigger"
        if reason is None and self.deadline.fires(step):
            reason = "deadline"
        if reason is not None:
            self.untie(model, optimizer, step, reason)
        return reason

    def untie(self, model: nn.Module, optimizer, step: int, reason: str) -> None:
        """Untie now, between optimizer steps, with the optimizer state of `config.optimizer_state`."""
        self.drop_probe()
        if self.emulation is not None:
            # The head has existed (and been wrapped) from the start: the untie only stops keeping it equal.
            self.emulation.release(optimizer, optimizer_state=self.config.optimizer_state)
            self.emulation = None
        else:
            untie_embeddings(model, optimizer, optimizer_state=self.config.optimizer_state)
            self.install_grad_sync(model)
        self._record_untie(step, reason)
        logger.info("untie: untied the LM head from the input embedding at step %d (%s)", step, reason)

    def install_grad_sync(self, model: nn.Module) -> None:
        """Average the head's gradient over ranks: a head created after DDP wrapped the model is not reduced by DDP."""
        if not self._grad_sync_installed:
            handle = sync_grads_across_ranks(output_weight(model))
            if handle is not None:
                self.registry.hook("gradient sync of the untied head", handle)
            self._grad_sync_installed = True

    def close(self) -> None:
        """The run is over: take off every install (`registry`: hooks, wrappers, the resume guard, the emulated
        tying's forwards and optimizer hooks); the model keeps the structure it was given (an untied head and its
        config marker, or the emulated tying's separate head). Idempotent."""
        self.drop_probe()
        self.registry.close()
        self.first_batch = None
        self._grad_sync_installed = False
        if self.phase in ("unsettled", "attached", "started", "stepping"):
            self.phase = "closed"

    def take_latest(self) -> dict[str, float]:
        """The `untie/*` values to log now: the tying state and the last measurement (once). A value the run has not
        measured (a pair whose symbol has not occurred yet, the trigger before its first average: NaN in `history`)
        is absent, not logged as NaN."""
        logs = {"untie/tied": 0.0 if self.untied else 1.0}
        if self.untie_step is not None:
            logs["untie/untie_step"] = self.untie_step
        logs.update({f"untie/{k}": v for k, v in self.latest.items() if not math.isnan(v)})
        self.latest = {}
        return logs

    # -- helpers -------------------------------------------------------------------------------------------------------
    def measures(self, step: int) -> bool:
        every = self.config.metrics_every
        return every > 0 and step > 0 and step % every == 0

    def drop_probe(self) -> None:
        if self.probe is not None:
            self.probe.remove()
            self.probe = None

    def _record(self, step: int, metrics: dict[str, float]) -> None:
        self.history.append({"step": step, **metrics})
        self.latest = summarize_pair_metrics(metrics)  # the history keeps every pair

    def _record_untie(self, step: int, reason: str) -> None:
        if self.untie_step is None:
            self.untie_step = step
            self.untie_reason = reason


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
        return self.run.history

    @property
    def trigger_state(self) -> dict | None:
        """The divergence trigger's running state (None without one)."""
        return self.run.trigger_state

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
        """What the run said at train begin it would do, in its own numbers (`untie.core.messages.plan_line`)."""
        return self.run.plan

    @property
    def tying_mode(self) -> str | None:
        """The tied phase's implementation, "live" or "emulated"."""
        return self.run.tying_mode

    @property
    def rule(self) -> UntieWhen | None:
        """The trigger's rule (`untie.UntieWhen`), "divergence" resolved for the pairs; None."""
        return self.run.rule

    @property
    def divergence(self) -> DivergenceTrigger | None:
        """The divergence trigger (`untie.signals.triggers.DivergenceTrigger`) or None."""
        return self.run.divergence

    @property
    def deadline(self) -> ScheduledTrigger:
        """`untie_at` (`untie.signals.triggers.ScheduledTrigger`)."""
        return self.run.deadline


def structure_of(model: nn.Module, emulating: bool = False) -> Structure:
    """The model's structure (`untie.structure.plan`): "emulated" while a run keeps its separate head equal
    (`emulating`)."""
    if emulating:
        return "emulated"
    return "tied" if is_tied(model) else "untied"


def model_facts(model: nn.Module, *, emulating: bool = False, optimizer_built: bool = False) -> ModelFacts:
    """What `plan_structure` needs to know about `model`, read once."""
    peft = is_peft_model(model)
    structure = structure_of(model, emulating)
    return ModelFacts(
        structure=structure,
        marked_untied=was_untied(model),
        peft=peft,
        config_says_untied=peft and untie_recorded(model),
        optimizer_built=optimizer_built,
        distributed=world_size() > 1,
        sharded=not peft and structure == "tied" and is_sharded(input_weight(model)),
    )
