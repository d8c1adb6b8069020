"""`UntieCallback`: the Trainer adapter of the run logic (`untie.core.run.UntieRun`)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from untie.adapters import trainer_glue as glue
from untie.adapters.views import RunViews
from untie.checkpoints.checkpoint import STATE_KEY, read_saved_run, saved_callback_state
from untie.core.phases import Adapter, RunOrderError
from untie.core.run import UntieRun
from untie.decision.settings import UntieConfig, build_config, settings_help
from untie.distributed import training_engine
from untie.errors import UntieValueError
from untie.registry import Registry
from untie.structure.peft_support import is_peft_model

logger = logging.getLogger(__name__)

#: The Trainer adapter, its row of the run's table (`untie.core.phases`) and the order its users follow.
TRAINER_CALLBACK = Adapter(
    "UntieCallback",
    "Trainer(processing_class=tokenizer)",
    # Trainer's start of training: the callback attached when the Trainer was built.
    {"UntieCallback.on_train_begin": (frozenset({"attached"}), None)},
    order=(
        "UntieCallback prepares the model when the Trainer is built, before the optimizer and the checkpoint loader "
        "see it (trainer.add_callback(...) afterwards is too late). Pass it to the constructor: "
        "Trainer(..., callbacks=[UntieCallback(...)])"
    ),
)


class UntieCallback(RunViews, TrainerCallback, ExportableState):
    """Decide, once, whether the LM head trains tied to the input embedding first, and untie it when tying starts to
    hurt, or at a deadline; never draw a head over trained weights.

    `Trainer(callbacks=[UntieCallback])` uses the defaults of `UntieConfig` (policy "by-share", the study's verdict): a
    model built fresh (its embedding matches a fresh draw of its initialiser, or ``from_scratch=True``) follows the
    study's choice for its embedding's share of the parameters (untied from step 0 with a head drawn by its initialiser,
    the input embedding at 16x at the lowest shares; or a tied phase to 2/3 of the run); every other tied model counts
    as trained and unties before the first step, its head a copy of the embedding. One log line at train begin says
    which, in the run's numbers, and why. Setting the schedule, whatever the value, runs it as set
    (`UntieCallback(untie_at=0.3)`: tied, then the divergence trigger, at 30% of the run at the latest; add
    ``untie_when=None`` to untie at the deadline only), and so does ``policy="off"``. An optimizer passed to Trainer
    (``optimizers=...``) gets the head too. Every `metrics_every` steps it measures the role signals of the shared
    matrix (drift between the two spaces once untied), feeds them to the divergence trigger (`untie_when`), and logs
    them as `untie/...` with Trainer's next log, next to `untie/tied` and `untie/untie_step`; `history` keeps every
    measurement. Saves its state in checkpoints and restores the untied structure by itself when a run resumes from a
    checkpoint saved after the untie.

    The run logic is `untie.core.run.UntieRun` (shared with `untie.Untier`, for custom loops); this class only maps
    Trainer's events onto it and handles what only Trainer does (building the model, loading checkpoints, logs).
    """

    def __init__(self, config: UntieConfig | None = None, **overrides: Any) -> None:
        """Args:
            config: the settings (`untie.UntieConfig`, e.g. parsed with
                ``HfArgumentParser((UntieConfig, TrainingArguments))``); default `UntieConfig()`.
            **overrides: settings by name, over `config` (``UntieCallback(untie_at=500, untie_when=None)``); an
                unknown name or a bad value is refused here.

        Every setting, with its meaning: `untie.UntieConfig` (``help(untie.UntieConfig)``).
        """
        self.run = UntieRun(build_config(config, overrides, "UntieCallback"), TRAINER_CALLBACK)
        """The run logic and state (`untie.core.run.UntieRun`)."""
        self._global_step = 0
        self._trainer_registry = Registry("UntieCallback: the Trainer")
        self.trainer_builds_optimizer = True
        """Trainer builds the optimizer (none was passed to it): a later call resuming a checkpoint may rebuild it."""
        """The Trainer's `train` entry (`trainer_glue.wrap_train`): for the Trainer's life, not one run's."""

    @classmethod
    def from_config(cls, config: UntieConfig, **overrides: Any) -> UntieCallback:
        """A callback with the settings of `config` (e.g. parsed with `HfArgumentParser`), and `overrides`."""
        return cls(config, **overrides)

    @property
    def config(self) -> UntieConfig:
        """The settings (`untie.UntieConfig`)."""
        return self.run.config

    # -- ExportableState -----------------------------------------------------------------------------------------------
    def state(self) -> dict:
        """What Trainer saves in `trainer_state.json`: the settings (`args`, which Trainer can rebuild the callback
        from) and the run state, in the layout `untie.Untier` saves too (`UntieRun.state_dict`), under
        `untie.checkpoints.checkpoint.STATE_KEY`. `on_train_begin` restores it from the checkpoint's TrainerState."""
        args = self.config.to_json_dict()  # a schedule setting left unset stays unset in the rebuilt callback
        return {"args": args, "attributes": {STATE_KEY: self.run.state_dict(self._global_step)}}

    # -- Trainer events ---------------------------------------------------------------------------------------------
    def on_init_end(self, args, state, control, model=None, processing_class=None, **kwargs):
        """Phase 1 (attach): the Trainer is built, its optimizer and wrappers are not."""
        handler = glue.find_handler(self)
        others = [cb for cb in getattr(handler, "callbacks", ()) if isinstance(cb, UntieCallback) and cb is not self]
        if others:
            raise UntieValueError(
                f"Trainer has {len(others) + 1} UntieCallbacks; one model has one untie. Pass a single "
                "UntieCallback(...) with all its settings."
            )
        glue.move_first(self)
        trainer = glue.find_trainer(self)
        self.trainer_builds_optimizer = trainer is None or trainer.optimizer is None
        # With the Trainer found, train() is entered first (train_call): the plan settles once the checkpoint is known.
        settle_later = trainer is not None and trainer.model_init is None
        # An optimizer passed to Trainer (optimizers=...) was built for the model as it is: a head the run adds
        # before the first step joins it.
        built = None if trainer is None or self.trainer_builds_optimizer else trainer.optimizer
        self.run.attach(
            model, engine=training_engine(args), tokenizer=processing_class, optimizer=built, settle_later=settle_later
        )
        if trainer is not None:
            # train() builds (model_init) and loads a resumed checkpoint before any callback event: see them first.
            glue.wrap_train(trainer, UntieCallback, self._trainer_registry)

    @contextmanager
    def train_call(self, trainer, folder: str | None) -> Iterator[None]:
        """One `trainer.train()` call, entered before Trainer builds or loads anything (`trainer_glue.wrap_train`):
        give the model the structure of the checkpoint in `folder` (refusing an incomplete one), attach the model of
        a later call, and with `model_init` each model it builds (each hyperparameter_search trial)."""
        later_call = self.run.phase == "closed"
        if trainer.model_init is not None or later_call:
            self.run.close()  # the model is built next (model_init), or this is a later call: attach anew
        saved = None
        if folder is not None:
            model = self.run.model or trainer.model  # PEFT adapters hold no embedding to look up
            saved = read_saved_run(folder, None if model is None or is_peft_model(model) else model)
        if saved is not None and later_call and self.trainer_builds_optimizer:
            # Trainer keeps the previous call's optimizer, built for the structure that call left (an untied head);
            # the checkpoint's run may be tied: Trainer builds it again for the structure resumed, and loads its state.
            trainer.optimizer = trainer.lr_scheduler = None
        if self.run.phase == "unsettled":
            self.run.settle(saved)  # the plan, now that the checkpoint (if any) is known
        if saved is not None:
            self.run.expect_checkpoint(saved, self.run.built_optimizer)  # a head the checkpoint needs joins it
        call = Registry("UntieCallback: one train() call")
        # The per-role learning rates' groups go in as Trainer builds the optimizer, before its scheduler and the
        # checkpoint's optimizer state: both then see the groups the run trains with.
        create_optimizer = self._splitting_groups(trainer, trainer.create_optimizer)
        call.replace(
            "Trainer.create_optimizer (per-role learning rates)", trainer, "create_optimizer", create_optimizer
        )
        if trainer.model_init is not None:
            attach = functools.partial(self.run.attach, **self.run.attach_args)
            prepared = glue.preparing(trainer.model_init, attach)
            call.replace("Trainer.model_init (attach each model)", trainer, "model_init", prepared)
        elif later_call:  # closed, or expecting the checkpoint of this call: `attach` applies it
            self.run.attach(trainer.model, **self.run.attach_args)
        try:
            yield
        finally:
            call.close()

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        """Phase 2 (start): the optimizer exists, and a resumed checkpoint has loaded."""
        if self.run.phase == "new":
            self._adopt_attached_run()
        # Attached when the Trainer was built (not added later), and the model Trainer trains is the one prepared.
        self.run.check("UntieCallback.on_train_begin")
        if model is not None and model is not self.run.model:
            raise RunOrderError(
                "UntieCallback: on_train_begin() got a model the run did not prepare (was trainer.model replaced "
                "after the Trainer was built?): its tied structure and checkpoint guard would be missing. Build a new "
                "Trainer with that model, or give Trainer a model_init that returns it."
            )
        # This train() call's run state: the checkpoint's when resuming (Trainer does not restore it), else fresh.
        self._global_step = state.global_step
        glue.keep_a_place_in_saved_state(state, self)
        saved = saved_callback_state(getattr(state, "stateful_callbacks", None)) if state.global_step else {}
        where = "the checkpoint's trainer_state.json"
        self.run.start(optimizer, state.global_step, state.max_steps, saved or None, where)
        # Trainer evaluates next, on every rank: that forward judges a drawn head, so that the step-0 report is of the
        # head the run trains (untie.structure.head_start).
        self._judge_evaluation(bool(args.eval_on_start))

    def on_step_begin(self, args, state, control, **kwargs):
        self._judge_evaluation(False)  # only the evaluation on start is judged: not one rank's sample later
        self.run.arm(state.global_step + 1)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        """The step's gradients are complete (all micro-batches, all ranks): read the role signals off them."""
        self.run.measure(state.global_step + 1)

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        self._global_step = state.global_step
        if self.run.end_of_step(state.global_step) is not None:
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
        """The run is over: every install comes off the model, the optimizer and the Trainer (`UntieRun.close`)."""
        self.run.close()

    # -- what the events use ----------------------------------------------------------------------------------------
    def _judge_evaluation(self, judged: bool) -> None:
        """Whether the first-batch check of a drawn head (if one waits) judges an evaluation forward."""
        check = self.run.structure.first_batch if self.run.structure is not None else None
        if check is not None:
            check.judge_evaluation = judged

    def _splitting_groups(self, trainer, create_optimizer):
        """`trainer.create_optimizer`, followed by the run's per-role param groups in the optimizer it returns (and in
        a scheduler passed to Trainer, built before them)."""

        @functools.wraps(create_optimizer)
        def create_optimizer_with_role_groups(*args, **kwargs):
            optimizer = create_optimizer(*args, **kwargs)
            # A model swapped in after the Trainer was built is refused by name at on_train_begin, not here.
            if self.run.structure is not None and trainer.optimizer is not None and trainer.model is self.run.model:
                self.run.split_groups(trainer.optimizer, trainer.lr_scheduler)
            return optimizer

        return create_optimizer_with_role_groups

    def _adopt_attached_run(self) -> None:
        """Take over the run `on_init_end` attached. With `restore_callback_states_from_checkpoint=True`, Trainer
        replaces this callback on resume with a new instance, built from the checkpoint's `args` after that event;
        the call under way (`trainer_glue.train_entry`) knows the instance that attached. Without one (a callback
        added after the Trainer was built), nothing is adopted and `on_train_begin`'s check refuses the run."""
        entry = glue.train_entry(glue.find_trainer(self))
        if entry is None or entry.active is None or entry.active is self:
            return
        self.run.adopt(entry.active.run)
        self.trainer_builds_optimizer = entry.active.trainer_builds_optimizer
        glue.move_first(self)  # Trainer appended the new instance after the logging integrations


UntieCallback.__doc__ = f"{UntieCallback.__doc__}\n\n    {settings_help().replace(chr(10), chr(10) + '    ')}"
