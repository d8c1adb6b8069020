"""`UntieError`: the one base of the library's own refusals, so that ``except untie.UntieError`` catches them all.

Each refusal also keeps the built-in type it has always had (`ValueError`, `RuntimeError`), so code that caught
those goes on working: `untie.UntieStateError` and `untie.PeftUnsupported` are `ValueError`s, the checkpoint tools'
errors (`untie.checkpoints.loading.CheckpointError`) are plain, and a run's calls out of order raise
`untie.core.run.RunOrderError`, a `RuntimeError`.
"""


class UntieError(Exception):
    """A refusal of the untie library: the message names the problem and the fix."""
