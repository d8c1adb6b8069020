"""Moved (issue 79): the settings are `untie.decision.settings`, torch-free beside the decision they feed. The public
names are `untie.UntieConfig` and `untie.parse_command_line`. This module keeps ``from untie.config import ...``
working for code written before the move, with a FutureWarning that names the new place."""

from __future__ import annotations

import warnings
from typing import Any


def __getattr__(name: str) -> Any:
    from untie.decision import settings

    value = getattr(settings, name)  # an unknown name raises AttributeError, as a module does
    warnings.warn(
        f"untie.config.{name} moved to untie.decision.settings.{name} (public names: untie.UntieConfig, "
        "untie.parse_command_line); untie.config will be removed in a later release.",
        FutureWarning,
        stacklevel=2,
    )
    return value
