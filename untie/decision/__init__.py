"""The decision layer, importable without torch (`tests/test_decision.py` imports it with torch blocked): the settings
as data (`settings.UntieConfig`), the schedule's rules (`triggers`: the deadline and the divergence trigger's rule),
the per-pair metric keys, the structure plans (`plan`), what a policy chooses from what was read (`policy_rules`), and
the run's one decision (`decide.decide(facts, settings, saved, step)`). The layers below read the model and act;
they decide nothing this package does not."""

from __future__ import annotations

import importlib
from types import ModuleType


def __getattr__(name: str) -> ModuleType:
    """`untie.decision.<module>` imports that module on first use (each is torch-free), as `untie.<module>` does."""
    if name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        module = importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as error:
        if error.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = module
    return module
