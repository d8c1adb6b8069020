"""`UntieCallback`: wires the surgery, trigger, distributed and checkpoint modules to Trainer events."""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_callback import CallbackHandler, ExportableState
from transformers.trainer_utils import get_last_checkpoint

from untie.adapters import check_peft_run, is_peft_model
from untie.checkpoint import SavedRun, install_resume_guard, read_saved_run, saved_callback_state
from untie.config import DEFAULT_UNTIE_AT, UntieConfig
from untie.distributed import (
    broadcast_decision,
    gather_rows,
    is_sharded,
    resolve_tying_mode,
    sync_grads_across_ranks,
    training_engine,
)
from untie.emulation import EmulatedTying
from untie.metrics import drift_metrics, role_signals, sampled_drift_metrics, summarize_pair_metrics
from untie.pairs import is_tokenizer, tokenizer_pairs
from untie.probe import RoleGradientProbe
from untie.surgery import is_tied, tie_embeddings, untie_embeddings, untie_recorded, was_untied
from untie.triggers import DivergenceTrigger, ScheduledTrigger, default_rule, pair_signal

logger = logging.getLogger(__name__)

#: Sample sizes of the drift metrics measured during training: about 0.1 s on CPU for GPT-2 small.
_DRIFT_SAMPLE = {"queries": 256, "pool": 4096, "rows": 2048}
#: The callback's attributes saved in checkpoints. Trainer's `restore_callback_states_from_checkpoint` sets each one
#: back with `setattr` on a new instance, so every key must be an attribute that takes its saved value.
_SAVED_ATTRIBUTES = ("untied", "untie_step", "untie_reason", "trigger_state", "history")
#: The model attribute where `on_init_end` leaves what it prepared, for a callback that Trainer re-creates later.
_SETUP_ATTR = "_untie_callback_setup"


@dataclass
class _Setup:
    """What `UntieCallback.on_init_end` prepared on a model, for an instance that did not see that event."""

    tying_mode: str
    emulation: EmulatedTying | None
    trigger_by_default: bool
    pairs: list[tuple[int, int]]


class UntieCallback(TrainerCallback, ExportableState):
    """Train tied, then untie the LM head from the input embedding when tying starts to hurt, or at a deadline.

    `Trainer(callbacks=[UntieCallback])` uses the defaults of `UntieConfig`: the divergence trigger, with a deadline
    at 30% of the run; `UntieCallback(untie_at=N)` alone unties at N. Every `metrics_every` steps it measures
    the role signals of the shared matrix (drift between the two spaces once untied), feeds them to the divergence
    trigger (`untie_when`), and logs them as `untie/...` with Trainer's next log, next to `untie/tied` and
    `untie/untie_step`; `history` keeps every measurement. Saves its state in checkpoints and restores the untied
    structure by itself when a run resumes from a checkpoint saved after the untie.
    """

    def __init__(self, untie_at: int | float | None = DEFAULT_UNTIE_AT, **settings: Any) -> None:
        self.config = UntieConfig(untie_at=untie_at, **settings)
        self.deadline = ScheduledTrigger(self.config.untie_at)
        """`untie_at`: the divergence trigger's deadline, or the fixed schedule when there is no trigger."""
        self.divergence = DivergenceTrigger(self.config.untie_when) if self.config.untie_when else None
        self.untied = False
        self.untie_step: int | None = None
        self.untie_reason: str | None = None
        """Why the model was untied: "trigger" (divergence), "deadline" (untie_at) or "checkpoint"/"start"."""
        self.pairs: list[tuple[int, int]] = list(self.config.pairs) if isinstance(self.config.pairs, list) else []
        """The measured pairs: `config.pairs`, or those read from the tokenizer at init for pairs="auto" / None."""
        self.history: list[dict[str, float]] = []
        """Every measurement: {"step": ..., signal: value, ...}; the smoothed trigger signal as "trigger"."""
        self._probe: RoleGradientProbe | None = None
        self._latest: dict[str, float] = {}
        self._grad_sync_handle = None
        self._emulation: EmulatedTying | None = None
        self._unmeasured_warned = False
        self._resuming: SavedRun | None = None
        self.tying_mode: str | None = None
        """The tied phase's implementation, "live" or "emulated", resolved from `config.tying_mode` at `on_init_end`."""

    # -- ExportableState ------------------------------------------------------------------------------------------
    def state(self) -> dict:
        return {"args": self.config.to_dict(), "attributes": {name: getattr(self, name) for name in _SAVED_ATTRIBUTES}}

    @property
    def trigger_state(self) -> dict | None:
        """The divergence trigger's running state (average, streak, firing step); None without a trigger."""
        return self.divergence.state_dict() if self.divergence is not None else None

    @trigger_state.setter
    def trigger_state(self, value: dict | None) -> None:
        if self.divergence is not None and value:
            self.divergence.load_state_dict(value)

    # -- Trainer events ---------------------------------------------------------------------------------------------
    def on_init_end(self, args, state, control, model=None, processing_class=None, **kwargs):
        self.tying_mode = resolve_tying_mode(self.config.tying_mode, training_engine(args))
        if self.config.pairs == "auto" or (self.config.pairs is None and is_tokenizer(processing_class)):
            self.pairs = _pairs_from(processing_class, model, asked=self.config.pairs == "auto")
        self._match_rule_to_pairs()
        handler = _calling(self)
        others = [cb for cb in getattr(handler, "callbacks", ()) if isinstance(cb, UntieCallback) and cb is not self]
        if others:
            raise ValueError(
                f"Trainer has {len(others) + 1} UntieCallbacks; one model has one untie. Pass a single "
                "UntieCallback(...) with all its settings."
            )
        _run_first(self)
        self._prepare(model)
        trainer = _calling(self, lambda caller: getattr(caller, "callback_handler", None))
        if trainer is not None:
            if trainer.model_init is not None:
                # Every train() call (each hyperparameter_search trial) builds a fresh model with model_init, after
                # this event and before the optimizer and the checkpoint loader see it: prepare each one the same way.
                trainer.model_init = _preparing(trainer.model_init, self._prepare)
            # train() loads a resumed checkpoint before any callback event: check it and match the model to it first.
            trainer.train = _checking_resume(trainer, self._before_resume)

    def _match_rule_to_pairs(self) -> None:
        """With pairs=None, "divergence" is the evidence rule only if the tokenizer gave pairs: else the pair-free
        rule. A per-pair rule the user chose, with no pairs to read, is refused."""
        rule = self.config.untie_when
        if rule is None or self.pairs or pair_signal(rule.signal) is None:
            return
        if self.config.rule_follows_pairs:
            self.config.untie_when = default_rule(with_pairs=False)
            self.divergence = DivergenceTrigger(self.config.untie_when)
            return
        raise ValueError(
            f"untie_when.signal={rule.signal!r} reads pairs, and there are none: Trainer has no tokenizer to read them "
            "from (processing_class) or its vocabulary has no case or word-start variants. Pass pairs=[(id_a, id_b), "
            "...], or a pair-free rule (untie_when='cancellation')."
        )

    def _prepare(self, model) -> None:
        """Give the model its tied-phase structure, before the optimizer exists and the model is wrapped."""
        self._emulation = None
        if is_peft_model(model):
            # PEFT owns the embedding and the head: only a base model untied before wrapping can train here.
            keep_untied = was_untied(model) or self.config.untie_at == 0
            check_peft_run(model, tied=is_tied(model), untie_recorded=untie_recorded(model), keep_untied=keep_untied)
        else:
            install_resume_guard(model)
            if was_untied(model) or self.config.untie_at == 0:
                # A checkpoint this library untied (re-tied on reload for T5/BART at equal values) or an untie at
                # step 0: untie now, before the optimizer exists and the model is wrapped. On an already-untied
                # model this only re-applies the bookkeeping that a reload loses.
                untie_embeddings(model)
            else:
                if not is_tied(model):
                    warnings.warn(
                        f"UntieCallback: the model arrived untied; tying it with tie_init={self.config.tie_init!r} "
                        "(the other matrix is dropped). To keep it untied, pass untie_at=0.",
                        stacklevel=2,
                    )
                    tie_embeddings(model, init=self.config.tie_init)
                if self.tying_mode == "emulated":
                    # The head gets its own parameter now, before the model is wrapped, and trains as if tied.
                    untie_embeddings(model)
                    self._emulation = EmulatedTying(model)
        self._leave_setup(model)
        if self._resuming is not None:
            self._match_checkpoint(model, self._resuming)

    def _leave_setup(self, model) -> None:
        """Record on the model what was prepared, for an instance Trainer creates later (`_adopt_setup`)."""
        setup = _Setup(self.tying_mode, self._emulation, self.config.trigger_by_default, self.pairs)
        setattr(model, _SETUP_ATTR, setup)

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

    def _match_checkpoint(self, model, saved: SavedRun) -> None:
        """Make a tied-phase checkpoint's implementation (live: one matrix; emulated: a head kept equal) the model's,
        before the optimizer is built, so the weights and the optimizer state load into the same structure."""
        if is_peft_model(model) or saved.untied is not False or saved.head_stored is None:
            return  # untied checkpoints are matched by the load guard; unknown formats (FSDP) are left to Trainer
        if saved.head_stored and self._emulation is None:
            # Written with emulated tying (FSDP2's default, or asked for): its head and optimizer state are separate.
            if self.config.tying_mode == "live":
                raise ValueError(
                    f"{saved.folder} was written in the tied phase with emulated tying (a head kept equal to the "
                    "embedding, FSDP2's mode), but this run asks for tying_mode='live'. Resume it with "
                    "UntieCallback(tying_mode='emulated') or tying_mode='auto' (which follows the checkpoint)."
                )
            logger.info("untie: %s was written with emulated tying; this run resumes it emulated.", saved.folder)
            if is_tied(model):
                untie_embeddings(model)
            self.tying_mode, self._emulation = "emulated", EmulatedTying(model)
        elif not saved.head_stored and self._emulation is not None:
            raise ValueError(
                f"{saved.folder} was written in the tied phase with live tying (one shared matrix), but this run "
                "emulates tying (FSDP2, or tying_mode='emulated'): its optimizer state does not fit. Resume it where "
                "live tying runs (one device or DDP) with tying_mode='auto' or 'live'."
            )
        elif not saved.head_stored and not is_tied(model):
            # untie_at=0 untied the model before the run; the checkpoint's run is tied: tie again so that it loads,
            # and the deadline unties it at the resume step (warned about in _start_run).
            tie_embeddings(model, init="input")
        self._leave_setup(model)

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self.tying_mode is None:
            self._adopt_setup(model)
        elif getattr(model, _SETUP_ATTR, None) is None:
            raise RuntimeError(
                "UntieCallback: Trainer is about to train a model that UntieCallback did not prepare (was "
                "trainer.model replaced after the Trainer was built?): its tied structure and checkpoint guard would "
                "be missing. Build a new Trainer with that model, or give Trainer a model_init that returns it."
            )
        self._start_run(state)
        self.deadline.resolve(state.max_steps)
        if self.divergence is not None:
            self.divergence.resolve(state.max_steps)
        if self._emulation is not None:
            self._begin_emulated(model, optimizer, state)
            return
        if not is_tied(model):
            # Untied before training: at step 0, or by the resume guard while loading an untied checkpoint.
            reason = self.untie_reason or ("checkpoint" if state.global_step else "start")
            self._mark_untied(self.untie_step if self.untie_step is not None else state.global_step, reason)
        elif self.untied:
            raise RuntimeError(
                "UntieCallback: the checkpoint state says the model was untied, but the model is tied. Resume with "
                "the same model class, or call untie.prepare_for_resume(model, checkpoint_dir) before train()."
            )
        elif self.deadline.fires(state.global_step):
            self._untie(model, optimizer, state.global_step, "deadline")
        elif self.config.metrics_every:
            self._probe = RoleGradientProbe(model, pairs=self.pairs)
            self._warn_short_run(state)

    def _adopt_setup(self, model) -> None:
        """Take over what `on_init_end` prepared. With `restore_callback_states_from_checkpoint=True`, Trainer replaces
        this callback on resume with a new instance, built from the checkpoint's `args` after that event."""
        setup = getattr(model, _SETUP_ATTR, None)
        if setup is None:
            raise RuntimeError(
                "UntieCallback was added after the Trainer was built (trainer.add_callback): it must prepare the "
                "model before the optimizer and the checkpoint loader see it. Pass it to the constructor: "
                "Trainer(..., callbacks=[UntieCallback(...)])."
            )
        self.tying_mode, self._emulation, self.pairs = setup.tying_mode, setup.emulation, setup.pairs
        self.config.trigger_by_default = setup.trigger_by_default  # the saved args name the default rule explicitly
        _run_first(self)  # Trainer appended the new instance after the logging integrations

    def _begin_emulated(self, model, optimizer, state) -> None:
        step = state.global_step
        if self.untied:  # resumed from a checkpoint saved after the untie: the head's values and state are its own
            self._emulation.release()
            self._emulation = None
            return
        self._emulation.attach_optimizer(optimizer)
        sharded = is_sharded(_both_weights(model)[0])
        if sharded and self.config.trigger_by_default:
            # Sharded (FSDP2), a measurement costs dense (V, d) buffers and a gather of W on every rank: the trigger
            # runs there only when the user asks for it (untie_when=...); the default is the deadline alone.
            logger.info("untie: FSDP2: the default divergence trigger is off (pass untie_when to turn it on).")
            self.divergence = None
        if self.deadline.fires(step):
            self._untie(model, optimizer, step, "deadline")
        elif self.config.metrics_every and (self.divergence is not None or not sharded):
            # Sharded, a measurement is taken only when a trigger reads it.
            self._probe = RoleGradientProbe(model, pairs=self.pairs, emulated=True)
            self._warn_short_run(state)

    def on_step_begin(self, args, state, control, **kwargs):
        if self._probe is not None:
            self._probe.armed = self._measures(state.global_step + 1)

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        """The step's gradients are complete (all micro-batches, all ranks): read the role signals off them."""
        if self._probe is None or not self._probe.armed:
            return
        self._probe.armed = False
        grads = self._probe.collect()
        if grads is None:
            self._warn_unmeasured()
            return
        step = state.global_step + 1
        signals = role_signals(*grads, weight=self._probe.dense_weight(), pairs=self.pairs)
        signals.update(self._probe.conditional_gaps(grads[0]))
        if self.divergence is not None:
            self.divergence.update(step, signals)
            signals["trigger"] = self.divergence.average if self.divergence.average is not None else math.nan
        self._record(step, signals)

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        step = state.global_step
        if not self.untied:
            reason = None
            if self.divergence is not None and self._measures(step):
                # Every rank takes rank 0's decision, at the same step.
                if broadcast_decision(self.divergence.fired_step is not None):
                    reason = "trigger"
            if reason is None and self.deadline.fires(step):
                reason = "deadline"
            if reason is not None:
                self._untie(model, optimizer, step, reason)
                control.should_log = True
                if self.config.save_at_untie and args.save_strategy != "no":
                    control.should_save = True
                elif self.config.save_at_untie:
                    logger.info("untie: no checkpoint at the untie step: save_strategy='no' (save_at_untie skipped).")
        elif self._measures(step):
            self._record(step, self._drift(model, step))
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None:
            logs["untie/tied"] = 0.0 if self.untied else 1.0
            if self.untie_step is not None:
                logs["untie/untie_step"] = self.untie_step
            logs.update({f"untie/{k}": v for k, v in self._latest.items()})
            self._latest = {}

    def on_train_end(self, args, state, control, **kwargs):
        if self._grad_sync_handle is not None:
            self._grad_sync_handle.remove()
            self._grad_sync_handle = None
        self._drop_probe()

    # -- helpers ------------------------------------------------------------------------------------------------------
    def _measures(self, step: int) -> bool:
        return self.config.metrics_every > 0 and step > 0 and step % self.config.metrics_every == 0

    def _record(self, step: int, metrics: dict[str, float]) -> None:
        self.history.append({"step": step, **metrics})
        self._latest = summarize_pair_metrics(metrics)  # the history keeps every pair

    def _drift(self, model, step: int) -> dict[str, float]:
        input_weight, output_weight = _both_weights(model)
        if not is_sharded(input_weight):
            return drift_metrics(input_weight, output_weight, pairs=self.pairs, seed=step, **_DRIFT_SAMPLE)
        # FSDP2: read only the sampled rows of each rank's shard (every rank samples the same rows).
        return sampled_drift_metrics(
            lambda ids: (gather_rows(input_weight, ids), gather_rows(output_weight, ids)),
            vocab=input_weight.shape[0],
            pairs=self.pairs,
            seed=step,
            **_DRIFT_SAMPLE,
        )

    def _untie(self, model, optimizer, step: int, reason: str) -> None:
        self._drop_probe()
        if self._emulation is not None:
            # The head has existed (and been wrapped) from the start: the untie only stops keeping it equal.
            self._emulation.release(optimizer, optimizer_state=self.config.optimizer_state)
            self._emulation = None
        else:
            untie_embeddings(model, optimizer, optimizer_state=self.config.optimizer_state)
            # The head is created after DDP wrapped the model: DDP will not reduce its gradient, so do it ourselves.
            self._grad_sync_handle = sync_grads_across_ranks(model.get_output_embeddings().weight)
        self._mark_untied(step, reason)
        logger.info("untie: untied the LM head from the input embedding at step %d (%s)", step, reason)

    def _warn_short_run(self, state) -> None:
        """Say once when `metrics_every` leaves the trigger too few measurements before the deadline (or the run's
        end) to fire, or leaves no measurement at all: a short fine-tune with the defaults would otherwise be a plain
        schedule without a word."""
        every, last = self.config.metrics_every, self.deadline.step or state.max_steps
        if self.divergence is not None:
            chances, needed = self.divergence.chances(every, last), self.divergence.rule.patience
            if chances >= needed:
                return
            fit = max(1, (last - max(self.divergence.warmup_step, 1) + 1) // needed)
            what = f"the model unties at the deadline, step {last}" if self.deadline.step else "the model stays tied"
            warnings.warn(
                f"UntieCallback: metrics_every={every} leaves the divergence trigger {chances} measurement(s) after "
                f"its warm-up (step {self.divergence.warmup_step}) and by step {last}; it needs {needed} in a row to "
                f"fire, so it cannot fire and {what}. Pass metrics_every <= {fit} to give it a chance, or "
                "untie_at=<step> alone for a plain schedule.",
                stacklevel=3,
            )
        elif every > last - state.global_step:  # no trigger reads them: a note, not a warning
            logger.info(
                "untie: metrics_every=%d measures nothing by step %d (the %s); pass a smaller metrics_every to see the "
                "role signals, or metrics_every=0 to turn them off.",
                every,
                last,
                "untie" if self.deadline.step else "end of the run",
            )

    def _warn_unmeasured(self) -> None:
        if not self._unmeasured_warned:
            self._unmeasured_warned = True
            warnings.warn(
                "UntieCallback: a measurement step ran no backward through the tied matrix's two roles, so the role "
                "signals (and the divergence trigger, which then waits for the deadline) are missing. Is the matrix "
                "frozen? Under torch.compile, module hooks added after a model of the same class was compiled in "
                "this process are not traced (torch._dynamo.config.skip_nnmodule_hook_guards): call "
                "torch._dynamo.reset() before building the Trainer.",
                stacklevel=2,
            )

    def _drop_probe(self) -> None:
        if self._probe is not None:
            self._probe.remove()
            self._probe = None

    def _mark_untied(self, step: int, reason: str) -> None:
        self.untied = True
        if self.untie_step is None:
            self.untie_step = step
            self.untie_reason = reason

    def _start_run(self, state) -> None:
        """This train() call's run state: the checkpoint's when resuming (Trainer does not restore it), else fresh, as
        the callback may come from an earlier train() call (training again, a hyperparameter_search trial)."""
        resumed = state.global_step > 0
        saved = saved_callback_state(getattr(state, "stateful_callbacks", None)) if resumed else {}
        attributes = saved.get("attributes", {})
        self.history = [h for h in attributes.get("history", []) if h["step"] <= state.global_step]
        self.divergence = DivergenceTrigger(self.config.untie_when) if self.config.untie_when else None
        self.trigger_state = attributes.get("trigger_state", attributes.get("trigger"))  # "trigger": its earlier name
        self.untied = bool(attributes.get("untied"))
        self.untie_step = attributes.get("untie_step") if self.untied else None
        self.untie_reason = attributes.get("untie_reason") if self.untied else None
        self._latest, self._unmeasured_warned = {}, False
        if resumed:
            self._warn_changed_settings(saved.get("args", {}), state.global_step)
        self._resuming = None

    def _warn_changed_settings(self, saved_args: dict, step: int) -> None:
        """Say which schedule settings differ from the checkpoint's run, and what they do now."""
        now = json.loads(json.dumps(self.config.to_dict()))  # as saved: tuples are lists
        changed = [k for k in ("untie_at", "untie_when") if k in saved_args and saved_args[k] != now[k]]
        if not changed:
            return
        what = ", ".join(f"{k}: {saved_args[k]!r} -> {now[k]!r}" for k in changed)
        if self.untied:
            warnings.warn(
                f"UntieCallback: resumed with changed settings ({what}), which have no effect: the checkpoint's run "
                f"untied at step {self.untie_step} ({self.untie_reason}) and a resumed run does not re-tie.",
                stacklevel=3,
            )
        else:
            warnings.warn(
                f"UntieCallback: resumed at step {step} with changed settings ({what}); the tied run continues "
                "under the new ones (a deadline already passed unties at the resume step).",
                stacklevel=3,
            )


def _both_weights(model) -> tuple:
    return model.get_input_embeddings().weight, model.get_output_embeddings().weight


def _pairs_from(processing_class, model, asked: bool = True) -> list[tuple[int, int]]:
    """pairs="auto" (`asked`) or None: the tokenizer's most frequent case and word-start variants that the model has
    rows for."""
    if processing_class is None:
        raise ValueError(
            "UntieCallback(pairs='auto') reads the pairs from the tokenizer: pass it to Trainer(processing_class="
            "tokenizer), or list the pairs yourself: pairs=[(id_a, id_b), ...]."
        )
    rows = model.get_input_embeddings().weight.shape[0] if model is not None else None
    pairs = tokenizer_pairs(processing_class, max_id=rows)
    if pairs:
        shown = ", ".join("/".join(p.tokens) for p in pairs[:6])
        logger.info("untie: pairs='auto' measures %d pairs from the tokenizer (%s, ...)", len(pairs), shown)
    elif asked:
        warnings.warn(
            "UntieCallback(pairs='auto'): the tokenizer's vocabulary has no case or word-start variants, so no pair "
            "is measured. Pass pairs=[(id_a, id_b), ...].",
            stacklevel=3,
        )
    else:
        logger.info("untie: the tokenizer's vocabulary has no case or word-start variants: no pairs are measured.")
    return [p.ids for p in pairs]


def _calling(callback: TrainerCallback, handler_of=lambda caller: caller):
    """The object calling `callback`'s event whose CallbackHandler (`handler_of(object)`) holds it, or None.

    Callbacks are handed neither the handler nor the trainer, so look for them among the callers' frames.
    """
    frame = sys._getframe(2)
    for _ in range(8):
        if frame is None:
            return None
        caller = frame.f_locals.get("self")
        handler = handler_of(caller)
        if isinstance(handler, CallbackHandler) and callback in handler.callbacks:
            return caller
        frame = frame.f_back
    return None


def _run_first(callback: TrainerCallback) -> None:
    """Move `callback` to the front of the Trainer's callback list.

    Trainer runs reporting integrations (TensorBoard, W&B) before user callbacks, so `untie/*` keys added in
    `on_log` would miss them.
    """
    handler = _calling(callback)
    if handler is None:
        logger.warning("untie: could not move UntieCallback ahead of the logging integrations; untie/* may be late.")
        return
    handler.callbacks.remove(callback)
    handler.callbacks.insert(0, callback)


def _checking_resume(trainer, before_resume):
    """`trainer.train`, calling `before_resume(trainer, folder)` with the checkpoint folder it will resume from (None
    when it does not resume) before anything is built or loaded."""
    train = trainer.train

    @functools.wraps(train)
    def train_checking_resume(resume_from_checkpoint=None, *args, **kwargs):
        folder = resume_from_checkpoint
        if folder is True:
            output_dir = trainer.args.output_dir
            folder = get_last_checkpoint(output_dir) if output_dir and os.path.isdir(output_dir) else None
        before_resume(trainer, os.fspath(folder) if folder else None)
        return train(resume_from_checkpoint, *args, **kwargs)

    return train_checking_resume


def _preparing(model_init, prepare):
    """`model_init` followed by `prepare` on the model it returns (keeping the signature Trainer inspects)."""

    @functools.wraps(model_init)
    def prepared_model_init(*trial):
        model = model_init(*trial)
        prepare(model)
        return model

    return prepared_model_init
