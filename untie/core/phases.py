"""The order of a run's calls: one table of transitions, `{call: (from phases, to phase)}`, and one check (`enter`).

A run (`untie.core.run.UntieRun`) is in one phase at a time:

* "new": nothing attached; "expecting": a checkpoint's structure is known before a model is attached (`attach`
  applies it);
* "unsettled": attached, the default's untie before the first step held back until `settle` knows the checkpoint
  (Trainer's `train()`); "attached": phase 1 done;
* "started": `start` ran and no step has begun (a custom loop may start again, resuming after a fresh start);
* "stepping": a step has begun (its measurement or its end): the run says what it does when it first gets here;
* "closed": `close` took every install off.

Each call moves the run from one of the phases it admits to one phase (None: it stays); a call from any other phase
raises `RunOrderError`, naming the order its adapter's users follow. The adapters add their own rows and order
(`Adapter`): their rows live with them (`untie.adapters.callback`, `untie.adapters.untier`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from untie.errors import UntieError

Phase = Literal["new", "expecting", "unsettled", "attached", "started", "stepping", "closed"]
Transition = tuple[frozenset[str], "Phase | None"]

#: Every phase (`close` comes from any of them).
PHASES: frozenset[str] = frozenset({"new", "expecting", "unsettled", "attached", "started", "stepping", "closed"})

#: The run's own calls.
RUN_TRANSITIONS: dict[str, Transition] = {
    "expect": (frozenset({"new", "expecting", "closed"}), "expecting"),  # a checkpoint before any model
    "expect_checkpoint": (frozenset({"attached", "started"}), None),  # a checkpoint for the attached model
    "attach": (frozenset({"new", "expecting", "unsettled", "attached", "closed"}), "attached"),
    "hold": (frozenset({"attached"}), "unsettled"),  # the default's untie waits for the checkpoint
    "settle": (frozenset({"unsettled"}), "attached"),
    "adopt": (frozenset({"new"}), None),  # takes the other run's phase with its state
    "start": (frozenset({"attached", "started"}), "started"),
    "arm": (frozenset({"started", "stepping"}), None),
    "measure": (frozenset({"started", "stepping"}), "stepping"),
    "end_of_step": (frozenset({"started", "stepping"}), "stepping"),
    "close": (PHASES, "closed"),
}

#: The order of the run's own calls, named by a call out of order.
RUN_ORDER = "attach (before the optimizer), start (with the optimizer), then the steps, then close"


class RunOrderError(UntieError, RuntimeError):
    """A run's calls came out of order (see `untie.core.phases`): e.g. a step before `start`."""


@dataclass(frozen=True)
class Adapter:
    """What an adapter tells the run about itself: the name users wrote (warnings and errors name it), how a
    tokenizer reaches it (for ``pairs="auto"``), its own calls' rows of the table and the order its users follow.
    The run's behaviour does not depend on it."""

    name: str
    tokenizer_hint: str
    transitions: dict[str, Transition] = field(default_factory=dict)
    order: str = RUN_ORDER
    loads_after_start: bool = False
    """Its users load a resumed optimizer state after `start` (a custom loop): an untie due at the resume step waits
    for the first forward, so that the state loads into the structure it was saved from."""


#: A run driven by hand (tests, a new adapter): the run's own calls only.
BY_HAND = Adapter("UntieRun", "tokenizer=tokenizer")


def enter(phase: str, call: str, adapter: Adapter) -> str:
    """The phase `call` leads to from `phase` (the run's table and `adapter`'s rows), or `RunOrderError` naming the
    order, where `call` does not come in `phase`."""
    admitted, to = adapter.transitions.get(call) or RUN_TRANSITIONS[call]
    if phase not in admitted:
        after = " (the run has taken steps; it cannot start again)" if phase == "stepping" else ""
        order = adapter.order if call.startswith(f"{adapter.name}.") else RUN_ORDER
        raise RunOrderError(
            f"{adapter.name}: {call}() in phase {phase!r}{after} (it needs {' or '.join(sorted(admitted))}). The "
            f"order is {order}."
        )
    return phase if to is None else to
