"""The untie policies: what a run does, chosen before training from what it can know of the model.

Each policy reads the model at attach, before the optimizer exists, and picks one of two plans:

* **untied from the start**: the head becomes its own matrix before the first step (``untie_at=0``, no trigger),
  drawn by the model's own initialiser for a freshly built model, a copy of the embedding for a loaded one
  (`UntieConfig.head_init` "auto");
* **as set**: the settings' `untie_at` / `untie_when` (by default: tied, the trigger, the deadline).

`policy="auto"` trains untied from the start where the input embedding is at least `UNTIED_FROM_START_SHARE` of the
parameters: on the decision map, where the embedding was most of the model, every tied phase cost more than it saved
(docs/recipes/decision-map.md, "The policy"). Its held-out validation failed below the share, at 40%, where the
schedule it kept trailed untied training.

`policy="fresh-untied"` trains a freshly built model untied from the start whatever its share (on the map's larger
corpus untied training was the best arm, or level with it, at every share measured), and runs a loaded model as
set. It is the next candidate, written down before its own held-out validation.

`policy="off"` always runs the settings as set. A model that arrives untied, or wrapped by PEFT, runs as set too
(`tie_init` decides whether it is tied first): there is no tied phase to skip.

The choice is said once at train begin and kept in the run state (`PolicyChoice.to_dict`), so a checkpoint says
what its run chose and why.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Literal

from torch import nn

from untie import _compat
from untie.config import POLICIES, PolicyName
from untie.engines.distributed import full_shape
from untie.structure.surgery import input_weight

#: The embedding's share of the parameters at or above which `policy="auto"` trains untied from the first step: the
#: midpoint of 40% (the first map's d 256, where tie-then-untie held its own) and 56% (d 128 x 4, where untied from the
#: start beat the default at every budget in both development seeds), rounded to 5%, by the rule written before those
#: runs ended. Fixed before the held-out validation; see docs/recipes/decision-map.md, "The policy".
UNTIED_FROM_START_SHARE = 0.5

__all__ = [
    "POLICIES",
    "UNTIED_FROM_START_SHARE",
    "PolicyChoice",
    "PolicyName",
    "choose_plan",
    "embedding_share",
    "is_freshly_built",
]

Plan = Literal["as set", "untied from the start"]


@dataclass(frozen=True)
class PolicyChoice:
    """What the policy chose for one run, and what it chose from."""

    policy: str
    """The policy asked for (`POLICIES`)."""
    plan: Plan
    """"untied from the start" (``untie_at=0``, no trigger) or "as set" (the settings' untie_at / untie_when)."""
    reason: str
    """Why, in words (the log line at train begin says it)."""
    embedding_share: float | None = None
    """The input embedding's share of the model's parameters (a tied matrix counted once); None where not read."""
    parameters: int | None = None
    """The model's parameters, a tied matrix counted once."""
    head_init: str = "copy"
    """How the head untied from the start begins (`UntieConfig.head_init` "auto" follows it): "model" (the model's
    own initialiser) for a freshly built model, "copy" of the embedding otherwise."""

    @property
    def untied_from_start(self) -> bool:
        return self.plan == "untied from the start"

    def to_dict(self) -> dict:
        return asdict(self)

    def message(self) -> str:
        """The log line at train begin."""
        share = "" if self.embedding_share is None else f" (embedding {self.embedding_share:.0%} of the parameters)"
        return f"untie: policy={self.policy!r}: {self.plan}{share}: {self.reason}"


def parameter_count(model: nn.Module) -> int:
    """The model's parameters, each shared tensor once, at their whole shape under every engine (ZeRO-3 partitions,
    FSDP2 shards)."""
    return sum(math.prod(full_shape(p)) for p in model.parameters())


def embedding_share(model: nn.Module) -> tuple[float, int]:
    """The input embedding's share of the model's parameters (a tied head is the same tensor, counted once), and the
    parameter count."""
    total = parameter_count(model)
    rows, width = full_shape(input_weight(model))[:2]
    return (rows * width / total if total else 0.0), total


def is_freshly_built(model: nn.Module) -> bool:
    """Whether `model` was built from a config rather than loaded: its config names no checkpoint (`from_pretrained`
    records where it loaded from in ``name_or_path``). A model loaded by hand (`load_state_dict`) looks fresh: its
    user passes ``head_init="copy"``."""
    return getattr(model, "config", None) is not None and not _compat.loaded_from(model)


def choose_plan(
    policy: str, model: nn.Module, *, tied: bool, peft: bool, threshold: float | None = None
) -> PolicyChoice:
    """The plan for a run of `model` (`tied`: it arrives tied; `peft`: wrapped by PEFT) under `policy` (`POLICIES`).

    `threshold`: the share at which "auto" trains untied from the start (default `UNTIED_FROM_START_SHARE`). Untied
    from the start, a freshly built model gets a head drawn by its own initialiser (`is_freshly_built`): on the
    decision map's development cells a head copied from the embedding trained 0.02-0.28 nat worse than a drawn one."""
    limit = UNTIED_FROM_START_SHARE if threshold is None else threshold
    if policy == "off":
        return PolicyChoice(policy, "as set", "the settings' untie_at / untie_when (policy='off')")
    if peft:
        return PolicyChoice(policy, "as set", "a PEFT model trains its adapters; the embedding's tying is its base's")
    share, total = embedding_share(model)
    if not tied:
        return PolicyChoice(
            policy, "as set", "the model arrived untied: no tied phase to choose (tie_init decides)", share, total
        )
    fresh = is_freshly_built(model)
    if policy == "fresh-untied":
        if not fresh:
            reason = "a loaded model: untie_at / untie_when as set ('fresh-untied' decides for a model built fresh)"
            return PolicyChoice(policy, "as set", reason, share, total)
        reason = (
            "a freshly built model: on the decision map's larger corpus a tied phase cost more than it saved at "
            "every share measured; the head is drawn by the model's initialiser (head_init). policy='off' runs "
            "untie_at / untie_when as set"
        )
        return PolicyChoice(policy, "untied from the start", reason, share, total, "model")
    if share >= limit:
        start = (
            "a freshly built model: the head is drawn by the model's initialiser"
            if fresh
            else "a loaded model: the head starts as a copy of the embedding"
        )
        reason = (
            f"at {limit:.0%} or more, a tied phase cost more than it saved on every budget the decision map measured; "
            f"{start} (head_init). policy='off' runs untie_at / untie_when as set"
        )
        return PolicyChoice(policy, "untied from the start", reason, share, total, "model" if fresh else "copy")
    reason = f"under {limit:.0%}: tie, then untie by the trigger or at the deadline (untie_at / untie_when)"
    return PolicyChoice(policy, "as set", reason, share, total)
