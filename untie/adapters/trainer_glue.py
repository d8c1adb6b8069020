"""What `UntieCallback` needs from Trainer beyond its public callback events, in one place.

Trainer hands a callback neither itself nor its callback handler, loads a resumed checkpoint before any event, may
rebuild the model (`model_init`) or the callback (`restore_callback_states_from_checkpoint`) after `on_init_end`, and
runs the reporting integrations before user callbacks. Each of these is met here:

* `find_handler` / `find_trainer`: the caller that holds the callback, found among the calling frames;
* `move_first`: the callback ahead of the reporting integrations, so that `untie/*` reaches them;
* `wrap_train`: `trainer.train` wrapped, for the Trainer's life, so that each call enters the UntieCallback the
  Trainer holds then (`UntieCallback.train_call`) before Trainer builds or loads anything: the checkpoint folder is
  seen before Trainer loads it, and the model of a later call (or each model `model_init` builds) is attached;
* `train_entry`: that wrapper, found on a Trainer (the run of the call under way, for a callback Trainer re-creates);
* `preparing`: `trainer.model_init` wrapped, for one `train()` call, to attach each model it builds;
* `add_to_log_history`: the `untie/*` values in `trainer.state.log_history` too.

The private upstream names these rely on are in `untie._compat`, with the versions checked.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable

from transformers import TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

from untie import _compat
from untie.registry import Registry

logger = logging.getLogger(__name__)


def find_handler(callback: TrainerCallback, handler_of: Callable = lambda caller: caller):
    """The object calling `callback`'s event whose CallbackHandler (`handler_of(object)`) holds it, or None."""

    def holds_callback(caller) -> bool:
        return _compat.holds_callback(handler_of(caller), callback)

    return _compat.find_caller(holds_callback, skip=3)


def find_trainer(callback: TrainerCallback):
    """The Trainer whose callback handler holds `callback`, or None."""
    return find_handler(callback, lambda caller: getattr(caller, "callback_handler", None))


def move_first(callback: TrainerCallback) -> None:
    """Move `callback` to the front of the Trainer's callback list.

    Trainer runs reporting integrations (TensorBoard, W&B) before user callbacks, so `untie/*` keys added in
    `on_log` would miss them.
    """
    handler = find_handler(callback)
    if handler is None:
        logger.warning("untie: could not move UntieCallback ahead of the logging integrations; untie/* may be late.")
        return
    _compat.move_callback_first(handler, callback)


class TrainEntry:
    """`trainer.train` wrapped (see `wrap_train`); `active` is the callback whose `train()` call is under way."""

    def __init__(self, trainer, callback_class: type, registry: Registry) -> None:
        self.trainer, self.callback_class, self.registry = trainer, callback_class, registry
        self.original = trainer.train
        self.active = None
        functools.update_wrapper(self, self.original)

    def __call__(self, resume_from_checkpoint=None, *args, **kwargs):
        trainer = self.trainer
        callback = self._current_callback()
        if callback is None:  # the callback was removed (trainer.remove_callback): the Trainer is plain again
            self.registry.close()
            return self.original(resume_from_checkpoint, *args, **kwargs)
        folder = resume_from_checkpoint
        if folder is True:
            output_dir = trainer.args.output_dir
            folder = get_last_checkpoint(output_dir) if output_dir and os.path.isdir(output_dir) else None
        self.active = callback
        try:
            with callback.train_call(trainer, os.fspath(folder) if folder else None):
                return self.original(resume_from_checkpoint, *args, **kwargs)
        finally:
            self.active = None
            # The run of the callback the Trainer holds now (one Trainer may have re-created) is over, also when
            # train() raised before on_train_end: its installs come off, and a later call attaches anew.
            current = self._current_callback()
            if current is not None:
                current.run.close()

    def _current_callback(self):
        handler = self.trainer.callback_handler
        return next((c for c in handler.callbacks if isinstance(c, self.callback_class)), None)


def wrap_train(trainer, callback_class: type, registry: Registry) -> None:
    """Wrap `trainer.train` (once per Trainer, for its life: each call is one run, and hyperparameter_search calls it
    once per trial) so that each call enters the `callback_class` instance the Trainer holds then. The wrapper takes
    itself off (`registry`) at the first call that finds no such callback."""
    if train_entry(trainer) is None:
        registry.replace(
            "Trainer.train entry (the Trainer's life)", trainer, "train", TrainEntry(trainer, callback_class, registry)
        )


def train_entry(trainer) -> TrainEntry | None:
    """The `TrainEntry` wrapping `trainer.train`, or None."""
    entry = vars(trainer).get("train") if trainer is not None else None
    return entry if isinstance(entry, TrainEntry) else None


def preparing(model_init: Callable, prepare: Callable) -> Callable:
    """`model_init` followed by `prepare` on the model it returns (keeping the signature Trainer inspects)."""

    @functools.wraps(model_init)
    def prepared_model_init(*trial):
        model = model_init(*trial)
        prepare(model)
        return model

    return prepared_model_init


def add_to_log_history(state, values: dict) -> None:
    """Trainer appended a copy of the logs to `log_history` before `on_log`: add `values` there too, so that
    `trainer.state.log_history` and `trainer_state.json` hold them."""
    if state.log_history and state.log_history[-1].get("step") == state.global_step:
        state.log_history[-1].update(values)


def keep_a_place_in_saved_state(state, callback) -> None:
    """Give `callback` its entry in `state.stateful_callbacks` (the TrainerState Trainer saves) where it has none: a
    run resumed from a checkpoint written without this callback (a plain Trainer run to which the library is added on
    resume) loads a TrainerState whose `stateful_callbacks` lacks it, and Trainer's `_save_checkpoint` then indexes it
    by class name and fails at the first save (`KeyError: 'UntieCallback'`; transformers 5.12.1-5.24.0, for any
    stateful callback added on resume). The entry is the callback's current state, which the save replaces."""
    callbacks = getattr(state, "stateful_callbacks", None)
    if isinstance(callbacks, dict):
        callbacks.setdefault(type(callback).__name__, callback.state())
