"""`UntieCallback`: wires the surgery, trigger, distributed and checkpoint modules to Trainer events."""

from __future__ import annotations

import logging
import sys
import warnings
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_callback import CallbackHandler, ExportableState

from untie.checkpoint import install_resume_guard, saved_callback_state
from untie.config import DEFAULT_UNTIE_AT, UntieConfig
from untie.distributed import refuse_unsupported_engines, sync_grads_across_ranks
from untie.surgery import is_tied, tie_embeddings, untie_embeddings, was_untied
from untie.triggers import ScheduledTrigger

logger = logging.getLogger(__name__)


class UntieCallback(TrainerCallback, ExportableState):
    """Train tied, then untie the LM head from the input embedding at a scheduled optimizer step.

    `Trainer(callbacks=[UntieCallback])` uses the defaults of `UntieConfig` (untie after 30% of the run).
    Logs `untie/tied` (1.0 while tied) and `untie/untie_step` with Trainer's logs, saves its state in checkpoints,
    and restores the untied structure by itself when a run resumes from a checkpoint saved after the untie.
    """

    def __init__(self, untie_at: int | float | None = DEFAULT_UNTIE_AT, **settings: Any) -> None:
        self.config = UntieConfig(untie_at=untie_at, **settings)
        self.trigger = ScheduledTrigger(self.config.untie_at)
        self.untied = False
        self.untie_step: int | None = None
        self._grad_sync_handle = None

    # -- ExportableState ------------------------------------------------------------------------------------------
    def state(self) -> dict:
        return {"args": self.config.to_dict(), "attributes": {"untied": self.untied, "untie_step": self.untie_step}}

    # -- Trainer events ---------------------------------------------------------------------------------------------
    def on_init_end(self, args, state, control, model=None, **kwargs):
        refuse_unsupported_engines(args)
        _run_first(self)
        install_resume_guard(model)
        if was_untied(model) or self.config.untie_at == 0:
            # A checkpoint this library untied (re-tied on reload for T5/BART at equal values) or an untie at step 0:
            # untie now, before the optimizer exists and the model is wrapped.
            # On an already-untied model this only re-applies the bookkeeping that a reload loses.
            untie_embeddings(model)
            self._mark_untied(state.global_step)
        elif not is_tied(model):
            warnings.warn(
                f"UntieCallback: the model arrived untied; tying it with tie_init={self.config.tie_init!r} (the other "
                "matrix is dropped). To keep it untied, pass untie_at=0.",
                stacklevel=2,
            )
            tie_embeddings(model, init=self.config.tie_init)

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self._restore(state)
        self.trigger.resolve(state.max_steps)
        if not is_tied(model):
            # Untied before training: at step 0, or by the resume guard while loading an untied checkpoint.
            self._mark_untied(self.untie_step if self.untie_step is not None else state.global_step)
        elif self.untied:
            raise RuntimeError(
                "UntieCallback: the checkpoint state says the model was untied, but the model is tied. Resume with "
                "the same model class, or call untie.prepare_for_resume(model, checkpoint_dir) before train()."
            )
        elif self.trigger.fires(state.global_step):
            self._untie(model, optimizer, state.global_step)

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        if not self.untied and self.trigger.fires(state.global_step):
            self._untie(model, optimizer, state.global_step)
            control.should_log = True
            if self.config.save_at_untie:
                control.should_save = True
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None:
            logs["untie/tied"] = 0.0 if self.untied else 1.0
            if self.untie_step is not None:
                logs["untie/untie_step"] = self.untie_step

    def on_train_end(self, args, state, control, **kwargs):
        if self._grad_sync_handle is not None:
            self._grad_sync_handle.remove()
            self._grad_sync_handle = None

    # -- helpers ------------------------------------------------------------------------------------------------------
    def _untie(self, model, optimizer, step: int) -> None:
        untie_embeddings(model, optimizer, optimizer_state=self.config.optimizer_state)
        # The head is created after DDP wrapped the model: DDP will not reduce its gradient, so do it ourselves.
        self._grad_sync_handle = sync_grads_across_ranks(model.get_output_embeddings().weight)
        self._mark_untied(step)
        logger.info("untie: untied the LM head from the input embedding at step %d", step)

    def _mark_untied(self, step: int) -> None:
        self.untied = True
        if self.untie_step is None:
            self.untie_step = step

    def _restore(self, state) -> None:
        """Take the untie step from the checkpoint's callback state (Trainer does not restore it by default)."""
        attributes = saved_callback_state(getattr(state, "stateful_callbacks", None)).get("attributes", {})
        if attributes.get("untied") and state.global_step > 0:
            self.untied = True
            self.untie_step = attributes.get("untie_step")


def _run_first(callback: TrainerCallback) -> None:
    """Move `callback` to the front of the Trainer's callback list.

    Trainer runs reporting integrations (TensorBoard, W&B) before user callbacks, so `untie/*` keys added in
    `on_log` would miss them. Callbacks are not handed the trainer, so find the handler that is calling us.
    """
    frame = sys._getframe(1)
    for _ in range(6):
        if frame is None:
            break
        handler = frame.f_locals.get("self")
        if isinstance(handler, CallbackHandler) and callback in handler.callbacks:
            handler.callbacks.remove(callback)
            handler.callbacks.insert(0, callback)
            return
        frame = frame.f_back
    logger.warning("untie: could not move UntieCallback ahead of the logging integrations; untie/* keys may be late.")
