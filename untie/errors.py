"""`UntieError`: the one base of the library's own refusals, so that ``except untie.UntieError`` catches them all.

Each refusal also keeps the built-in type it has always had, so code that caught those goes on working: a bad value
is an `UntieValueError` (a `ValueError`), a bad type an `UntieTypeError`, a refusal of the model's or the run's state
an `UntieRuntimeError`, a missing or existing path an `UntieFileNotFoundError` / `UntieFileExistsError`;
`untie.UntieStateError` and `untie.PeftUnsupported` are `ValueError`s, the checkpoint tools' errors
(`untie.checkpoints.loading.CheckpointError`) are plain, and a run's calls out of order raise
`untie.core.phases.RunOrderError`, a `RuntimeError`. `tests/test_errors.py` checks that no refusal in the library raises
a bare built-in.
"""


class UntieError(Exception):
    """A refusal of the untie library: the message names the problem and the fix."""


class UntieValueError(UntieError, ValueError):
    """A setting, a checkpoint or a model the library refuses: a `ValueError` too."""


class UntieTypeError(UntieError, TypeError):
    """An argument of the wrong type (an unknown setting name, a config of another class): a `TypeError` too."""


class UntieRuntimeError(UntieError, RuntimeError):
    """A state of the model, the optimizer or the Trainer the library cannot work from: a `RuntimeError` too."""


class UntieFileNotFoundError(UntieError, FileNotFoundError):
    """A path the library was given does not exist: a `FileNotFoundError` too."""


class UntieFileExistsError(UntieError, FileExistsError):
    """A path the library would write exists already: a `FileExistsError` too."""
