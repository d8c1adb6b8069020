"""What `UntieCallback` needs from Trainer beyond its public callback events, in one place.

Trainer hands a callback neither itself nor its callback handler, loads a resumed checkpoint before any event, may
rebuild the model (`model_init`) or the callback (`restore_callback_states_from_checkpoint`) after `on_init_end`, and
runs the reporting integrations before user callbacks. Each of these is met here:

* `find_handler` / `find_trainer`: the caller that holds the callback, found among the calling frames;
* `move_first`: the callback ahead of the reporting integrations, so that `untie/*` reaches them;
* `checking_resume`: `trainer.train` wrapped to see the checkpoint folder before Trainer loads it;
* `preparing`: `trainer.model_init` wrapped to prepare each model it builds;
* `leave_setup` / `prepared_setup`: what `on_init_end` prepared, kept on the model for an instance Trainer builds later;
* `add_to_log_history`: the `untie/*` values in `trainer.state.log_history` too.

The private upstream names these rely on are in `untie._compat`, with the versions checked.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

from transformers import TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

from untie import _compat
from untie.emulation import EmulatedTying

logger = logging.getLogger(__name__)

#: The model attribute where `on_init_end` leaves what it prepared, for a callback that Trainer re-creates later.
SETUP_ATTR = "_untie_callback_setup"


@dataclass
class Setup:
    """What `UntieCallback.on_init_end` prepared on a model, for an instance that did not see that event."""

    tying_mode: str
    emulation: EmulatedTying | None
    pairs: list[tuple[int, int]]


def leave_setup(model, setup: Setup) -> None:
    """Record on the model what was prepared (read back by `prepared_setup`)."""
    setattr(model, SETUP_ATTR, setup)


def prepared_setup(model) -> Setup | None:
    """What an `UntieCallback` prepared on `model`, or None if none did."""
    return getattr(model, SETUP_ATTR, None)


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


def checking_resume(trainer, before_resume: Callable) -> Callable:
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
