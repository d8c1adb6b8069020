"""`UntieCallback`: the Trainer adapter of the run logic (`untie.run.UntieRun`)."""

from __future__ import annotations

import logging
from typing import Literal

from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from untie import trainer_glue as glue
from untie.checkpoint import STATE_KEY, read_saved_run, saved_callback_state
from untie.config import DEFAULT_UNTIE_AT, OptimizerStateInit, RuleSpec, TieInit, TyingMode, UntieConfig
from untie.distributed import training_engine
from untie.pairs import is_tokenizer
from untie.peft_support import is_peft_model
from untie.plan import SavedFacts
from untie.run import TRAINER_CALLBACK, UntieRun

logger = logging.getLogger(__name__)


def _run_attribute(name: str, doc: str) -> property:
    """A callback attribute that is the run object's (`UntieRun`), readable and settable (Trainer restores saved
    attributes with `setattr` on a new instance)."""
    return property(lambda self: getattr(self.run, name), lambda self, value: setattr(self.run, name, value), doc=doc)


class UntieCallback(TrainerCallback, ExportableState):
    """Train tied, then untie the LM head from the input embedding when tying starts to hurt, or at a deadline.

    `Trainer(callbacks=[UntieCallback])` uses the defaults of `UntieConfig`: the divergence trigger, with a deadline
    at 30% of the run; `UntieCallback(untie_at=N, untie_when=None)` unties at N (a fixed schedule). Every
    `metrics_every` steps it measures the role signals of the shared matrix (drift between the two spaces once
    untied), feeds them to the divergence trigger (`untie_when`), and logs them as `untie/...` with Trainer's next
    log, next to `untie/tied` and `untie/untie_step`; `history` keeps every measurement. Saves its state in
    checkpoints and restores the untied structure by itself when a run resumes from a checkpoint saved after the
    untie.

    The run logic is `untie.run.UntieRun` (shared with `untie.Untier`, for custom loops); this class only maps
    Trainer's events onto it and handles what only Trainer does (building the model, loading checkpoints, logs).
    """

    untied = _run_attribute("untied", "Whether the model has been untied.")
    untie_step = _run_attribute("untie_step", "The optimizer step of the untie (None while tied).")
    untie_reason = _run_attribute(
        "untie_reason", 'Why the model was untied: "trigger", "deadline", "checkpoint" or "start".'
    )
    history = _run_attribute("history", 'Every measurement: {"step": ..., signal: value, ...}.')
    trigger_state = _run_attribute("trigger_state", "The divergence trigger's running state (None without one).")
    pairs = _run_attribute("pairs", "The measured pairs: `config.pairs`, or those read from the tokenizer.")
    tying_mode = _run_attribute("tying_mode", 'The tied phase\'s implementation, "live" or "emulated".')
    rule = _run_attribute("rule", 'The trigger\'s rule (`untie.UntieWhen`), "divergence" resolved for the pairs; None.')
    divergence = _run_attribute("divergence", "The divergence trigger (`untie.triggers.DivergenceTrigger`) or None.")
    deadline = _run_attribute("deadline", "`untie_at` (`untie.triggers.ScheduledTrigger`).")

    def __init__(
        self,
        untie_at: int | float | None = DEFAULT_UNTIE_AT,
        *,
        untie_when: RuleSpec = "divergence",
        metrics_every: int = 50,
        pairs: list[tuple[int, int]] | Literal["auto"] | None = None,
        optimizer_state: OptimizerStateInit = "copy",
        tie_init: TieInit | None = None,
        tying_mode: TyingMode = "auto",
        save_at_untie: bool = True,
    ) -> None:
        """Args:
            untie_at: the untie step at the latest: an int is a global optimizer step (0 = before the first step),
                a float in (0, 1) a fraction of `max_steps`, None no deadline. With ``untie_when=None`` it is a
                fixed schedule.
            untie_when: the divergence trigger. ``"divergence"`` (default): the evidence rule when pairs are
                measured, the pair-free rule otherwise; a name from
                `untie.RULES`; an `untie.UntieWhen` or its dict; None: untie at `untie_at` only.
            metrics_every: measure every this many optimizer steps (role signals while tied, drift after the untie),
                logged as ``untie/...``; 0 measures nothing and needs ``untie_when=None``.
            pairs: token-id pairs known to be semantically equivalent, measured too. ``"auto"``: the tokenizer's
                case and word-start variants (Trainer's `processing_class`); None: ``"auto"`` when Trainer has a
                tokenizer; ``[]``: none.
            optimizer_state: the untied head's optimizer state: ``"copy"`` (the shared matrix's moments),
                ``"reset"``, or ``"fresh"`` (the embedding's state is emptied too).
            tie_init: a model that arrives untied (its head a trained matrix of its own): None (default) keeps
                it untied from the first step, so nothing trained is dropped; ``"input"``, ``"output"`` or
                ``"mean"`` ties it at construction from that matrix (or their mean).
            tying_mode: ``"live"`` (one shared parameter), ``"emulated"`` (the head kept equal to the embedding:
                FSDP2, DeepSpeed) or ``"auto"`` (emulated under FSDP2 and DeepSpeed, else live).
            save_at_untie: ask Trainer for a checkpoint at the untie step.

        Every setting is a field of `untie.UntieConfig`, which checks them (bad values raise `ValueError` here).
        """
        config = UntieConfig(
            untie_at=untie_at,
            untie_when=untie_when,
            metrics_every=metrics_every,
            pairs=pairs,
            optimizer_state=optimizer_state,
            tie_init=tie_init,
            tying_mode=tying_mode,
            save_at_untie=save_at_untie,
        )
        self.run = UntieRun(config, TRAINER_CALLBACK)
        """The run logic and state (`untie.run.UntieRun`)."""
        self._resuming: SavedFacts | None = None
        self._global_step = 0

    @classmethod
    def from_config(cls, config: UntieConfig) -> UntieCallback:
        """A callback with the settings of `config` (e.g. parsed with `HfArgumentParser`)."""
        return cls(**config.to_dict())

    @property
    def config(self) -> UntieConfig:
        """The settings (`untie.UntieConfig`)."""
        return self.run.config

    # -- ExportableState ------------------------------------------------------------------------------------------
    def state(self) -> dict:
        """What Trainer saves in `trainer_state.json`: the settings (`args`, which Trainer can rebuild the callback
        from) and the run state, in the layout `untie.Untier` saves too (`UntieRun.state_dict`), under
        `untie.checkpoint.STATE_KEY`. `on_train_begin` restores it from the checkpoint's TrainerState."""
        return {"args": self.config.to_dict(), "attributes": {STATE_KEY: self.run.state_dict(self._global_step)}}

    # -- Trainer events ---------------------------------------------------------------------------------------------
    def on_init_end(self, args, state, control, model=None, processing_class=None, **kwargs):
        run = self.run
        run.use_tying_mode(training_engine(args))
        if self.config.pairs == "auto" or (self.config.pairs is None and is_tokenizer(processing_class)):
            run.read_pairs(processing_class, model, asked=self.config.pairs == "auto")
        run.match_rule_to_pairs()
        handler = glue.find_handler(self)
        others = [cb for cb in getattr(handler, "callbacks", ()) if isinstance(cb, UntieCallback) and cb is not self]
        if others:
            raise ValueError(
                f"Trainer has {len(others) + 1} UntieCallbacks; one model has one untie. Pass a single "
                "UntieCallback(...) with all its settings."
            )
        glue.move_first(self)
        self._prepare(model)
        trainer = glue.find_trainer(self)
        if trainer is not None:
            if trainer.model_init is not None:
                # Every train() call (each hyperparameter_search trial) builds a fresh model with model_init, after
                # this event and before the optimizer and the checkpoint loader see it: prepare each one the same way.
                trainer.model_init = glue.preparing(trainer.model_init, self._prepare)
            # train() loads a resumed checkpoint before any callback event: check it and match the model to it first.
            trainer.train = glue.checking_resume(trainer, self._before_resume)

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self.tying_mode is None:
            self._adopt_setup(model)
        elif glue.prepared_setup(model) is None:
            raise RuntimeError(
                "UntieCallback: Trainer is about to train a model that UntieCallback did not prepare (was "
                "trainer.model replaced after the Trainer was built?): its tied structure and checkpoint guard would "
                "be missing. Build a new Trainer with that model, or give Trainer a model_init that returns it."
            )
        # This train() call's run state: the checkpoint's when resuming (Trainer does not restore it), else fresh, as
        # the callback may come from an earlier train() call (training again, a hyperparameter_search trial).
        self._global_step = state.global_step
        saved = saved_callback_state(getattr(state, "stateful_callbacks", None)) if state.global_step else {}
        if saved:
            self.run.load_state_dict(saved, "the checkpoint's trainer_state.json", step=state.global_step)
        else:
            self.run.restore({}, state.global_step)
        self._resuming = None
        self.run.begin(model, optimizer, state.global_step, state.max_steps)
        self.run.announce(state.global_step, state.max_steps)

    def on_step_begin(self, args, state, control, **kwargs):
        self.run.arm(state.global_step + 1)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        """The step's gradients are complete (all micro-batches, all ranks): read the role signals off them."""
        self.run.measure(state.global_step + 1)

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        self._global_step = state.global_step
        if self.run.end_of_step(model, optimizer, state.global_step) is not None:
            control.should_log = True
            if self.config.save_at_untie and args.save_strategy != "no":
                control.should_save = True
            elif self.config.save_at_untie:
                logger.info("untie: no checkpoint at the untie step: save_strategy='no' (save_at_untie skipped).")
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None:
            return
        values = self.run.take_latest()
        logs.update(values)  # what the reporting integrations (console, TensorBoard, W&B) send
        glue.add_to_log_history(state, values)

    def on_train_end(self, args, state, control, **kwargs):
        self.run.close()

    # -- what the events use ----------------------------------------------------------------------------------------
    def _prepare(self, model) -> None:
        """Give the model its tied-phase structure, before the optimizer exists and the model is wrapped."""
        self.run.prepare(model)
        self._leave_setup(model)
        if self._resuming is not None:
            self._match_checkpoint(model, self._resuming)

    def _leave_setup(self, model) -> None:
        """Record on the model what was prepared, for an instance Trainer creates later (`_adopt_setup`)."""
        run = self.run
        glue.leave_setup(model, glue.Setup(run.tying_mode, run.emulation, run.pairs))

    def _before_resume(self, trainer, folder: str | None) -> None:
        """Called by `trainer.train` before anything is loaded: refuse an incomplete checkpoint folder, and give the
        model (built now, or by model_init right after) the structure of the checkpoint's run."""
        self._resuming = None
        if folder is None:
            return
        model = trainer.model  # with model_init, a model of the same class: the one trained is built next
        # PEFT adapters hold no embedding to look up; _match_checkpoint leaves them alone.
        self._resuming = read_saved_run(folder, None if model is None or is_peft_model(model) else model)
        if trainer.model_init is None:
            self._match_checkpoint(model, self._resuming)

    def _match_checkpoint(self, model, saved: SavedFacts) -> None:
        """Give the model the structure of the checkpoint's run (`untie.plan`), before the optimizer is built."""
        if is_peft_model(model):
            return  # PEFT adapters hold no embedding; `prepare` checked the model
        self.run.match_saved(model, saved)
        self._leave_setup(model)

    def _adopt_setup(self, model) -> None:
        """Take over what `on_init_end` prepared. With `restore_callback_states_from_checkpoint=True`, Trainer replaces
        this callback on resume with a new instance, built from the checkpoint's `args` after that event."""
        setup = glue.prepared_setup(model)
        if setup is None:
            raise RuntimeError(
                "UntieCallback was added after the Trainer was built (trainer.add_callback): it must prepare the "
                "model before the optimizer and the checkpoint loader see it. Pass it to the constructor: "
                "Trainer(..., callbacks=[UntieCallback(...)])."
            )
        self.run.tying_mode, self.run.emulation, self.run.pairs = setup.tying_mode, setup.emulation, setup.pairs
        self.run.match_rule_to_pairs()  # "divergence" follows the pairs found then
        glue.move_first(self)  # Trainer appended the new instance after the logging integrations
