"""`Registry`: every install a run makes on objects it does not own, each recorded with its removal.

A run touches the model (hooks, the resume guard, a replaced `forward`), the optimizer (step and state-dict hooks, a
wrapped `step`), the Trainer (its `model_init` during a `train()` call) and the Accelerator (save / load hooks, a
wrapped `save_state`). Each goes through `Registry.hook`, `Registry.replace` or `Registry.add`, which records how to
take it off; `close()` takes everything off, newest first, so that the objects are as they were before the run, but
for the structure the run gave the model on purpose (an untied head, its config marker). A part of the run that ends
before the run does (the role-gradient probe, the emulated tying) gets a child registry (`child`) and closes it then;
closing the parent closes the children left open.

accelerate's pattern, with one place to look: every `add_hook_to_module` has its `remove_hook_from_module`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

Handle = TypeVar("Handle")
_MISSING = object()


class Registry:
    """What a run (or a part of it) installed, with the removals that undo it (see the module docstring)."""

    def __init__(self, name: str = "run", on_close: Callable[[], None] | None = None) -> None:
        self.name = name
        self._removals: list[tuple[str, Callable[[], None]]] = []
        self._children: list[Registry] = []
        self._on_close = on_close  # a child leaves its parent's list

    # -- installs ------------------------------------------------------------------------------------------------------
    def add(self, what: str, removal: Callable[[], None]) -> None:
        """Record an install done by the caller, and the call that takes it off."""
        self._removals.append((what, removal))

    def hook(self, what: str, handle: Handle) -> Handle:
        """Record a torch hook handle (`register_*_hook`, `register_*_pre_hook`): its `remove()` takes it off."""
        self.add(what, handle.remove)  # type: ignore[attr-defined]
        return handle

    def replace(self, what: str, owner: Any, name: str, value: Any) -> None:
        """Set the instance attribute `owner.name` to `value`; the removal puts back what the instance held before
        (its own attribute, or none, so that the class's shows through again), and only while `value` is still there:
        a replacement someone set on top of ours is left alone."""
        before = vars(owner).get(name, _MISSING)
        setattr(owner, name, value)

        def restore() -> None:
            if vars(owner).get(name, _MISSING) is not value:
                return
            if before is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, before)

        self.add(what, restore)

    def child(self, name: str) -> Registry:
        """A registry for a part of the run that may end first; `close()` of this one closes it too."""
        child = Registry(f"{self.name}/{name}", on_close=lambda: self._children.remove(child))
        self._children.append(child)
        return child

    # -- removal -------------------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Take off every install of this registry and its children, newest first (idempotent)."""
        for child in list(reversed(self._children)):
            child.close()
        while self._removals:
            _what, removal = self._removals.pop()
            removal()
        if self._on_close is not None:
            on_close, self._on_close = self._on_close, None
            on_close()

    def installed(self) -> list[str]:
        """What is installed now, oldest first, children after their parent's own (for tests and debugging)."""
        return [what for what, _ in self._removals] + [w for child in self._children for w in child.installed()]

    def __bool__(self) -> bool:
        return bool(self._removals) or any(self._children)
