"""The untie policies: what a run does, chosen before training from what it can know of the model.

Each policy reads the model at attach, before the optimizer exists, and picks one of two plans:

* **untied from the start**: the head becomes its own matrix before the first step (``untie_at=0``, no trigger),
  drawn by the model's own initialiser for a freshly built model, a copy of the embedding for a loaded one
  (`UntieConfig.head_init` "auto"; weights loaded by hand count as loaded: `is_freshly_built`);
* **as set**: the settings' `untie_at` / `untie_when` (by default: tied, the trigger, the deadline).

`policy="auto"` trains untied from the start where the input embedding is at least `UNTIED_FROM_START_SHARE` of the
parameters: on the decision map, where the embedding was most of the model, every tied phase cost more than it saved
(docs/recipes/decision-map.md, "The policy"). Its held-out validation failed below the share, at 40%, where the
schedule it kept trailed untied training.

`policy="fresh-untied"` trains a freshly built model untied from the start whatever its share (on the map's larger
corpus untied training was the best arm, or level with it, at every share measured), and runs a loaded model as
set. Written down before its own held-out validation, it passed it, and it is the default: an unset
`UntieConfig.policy` follows it unless a tied phase is asked for (`UntieConfig.chosen_policy`).

`policy="off"` always runs the settings as set. A model that arrives untied, or wrapped by PEFT, runs as set too
(`tie_init` decides whether it is tied first): there is no tied phase to skip.

The choice is said once at train begin and kept in the run state (`PolicyChoice.to_dict`), so a checkpoint says
what its run chose and why.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Literal

import torch
from torch import nn

from untie import _compat
from untie.config import POLICIES, PolicyName
from untie.engines.distributed import full_shape, is_split
from untie.structure.surgery import input_weight

#: The embedding's share of the parameters at or above which `policy="auto"` trains untied from the first step: the
#: midpoint of 40% (the first map's d 256, where tie-then-untie held its own) and 56% (d 128 x 4, where untied from the
#: start beat the default at every budget in both development seeds), rounded to 5%, by the rule written before those
#: runs ended. Fixed before the held-out validation; see docs/recipes/decision-map.md, "The policy".
UNTIED_FROM_START_SHARE = 0.5
#: How many times a Gaussian draw's spread of row norms (`embedding_row_spread`) an embedding may show and still count
#: as freshly drawn. Measured (2026-11-26): 0.82-1.14 times for the 9 tiny architectures of `untie.testing` over seeds
#: 0-4, 1.00-1.01 for the decision map's GPT-2 shapes at widths 64-256; trained, the map's tied d 128 x 12 and d 64 x 4
#: (32k vocabulary) runs showed 1.4 times at step 25 and 3.0-4.3 from step 50 on (their checkpoints).
DRAWN_SPREAD_LIMIT = 2.0

__all__ = [
    "POLICIES",
    "UNTIED_FROM_START_SHARE",
    "PolicyChoice",
    "PolicyName",
    "DRAWN_SPREAD_LIMIT",
    "choose_plan",
    "embedding_row_spread",
    "embedding_share",
    "is_freshly_built",
    "loaded_as",
    "looks_trained",
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


def embedding_row_spread(model: nn.Module) -> tuple[float, float] | None:
    """How much the input embedding's row norms vary (their standard deviation over their mean, zero rows left out:
    padding), and how much they vary in a Gaussian draw of the same width (about 1 / sqrt(2 * width)); None where the
    rows cannot be read here (a shard, a ZeRO-3 partition, the meta device, quantized values) or are all zero.

    An initialiser draws the rows independently, so their norms barely differ (uniform and truncated normal draws
    differ less than a Gaussian one); training moves frequent and rare symbols' rows apart."""
    weight = input_weight(model)
    if is_split(weight) or weight.device.type == "meta" or not weight.is_floating_point():  # not here, or quantized
        return None
    with torch.no_grad():
        norms = torch.linalg.vector_norm(weight.detach(), dim=-1, dtype=torch.float32)  # no float copy of bf16
        norms = norms[norms > 0]
        if norms.numel() < 2:
            return None
        spread = float(norms.std() / norms.mean())
    return spread, 1.0 / math.sqrt(2 * weight.shape[-1])


def looks_trained(model: nn.Module) -> str:
    """Why the input embedding does not look like an initialiser's draw ("" where it does, or cannot be read): its
    row norms vary more than `DRAWN_SPREAD_LIMIT` times as much as a Gaussian draw's. Every rank of a distributed
    run reads its own copy and they agree without a collective: a fresh draw sits near 1 times on every rank, whatever
    its seed, and weights loaded by hand are the same on every rank."""
    measured = embedding_row_spread(model)
    if measured is None or measured[0] <= DRAWN_SPREAD_LIMIT * measured[1]:
        return ""
    spread, drawn = measured
    return f"its embedding's row norms vary {spread / drawn:.1f} times as much as a random draw's: trained weights"


def loaded_as(model: nn.Module) -> str:
    """How `model` came by trained weights, in words ("" for a model built from its config): its config names the
    checkpoint `from_pretrained` loaded (``name_or_path``), or its input embedding does not look like an
    initialiser's draw (`looks_trained`: weights loaded by hand, `load_state_dict`)."""
    if getattr(model, "config", None) is None:
        return "a model without a transformers config"
    if _compat.loaded_from(model):
        return "a loaded model"
    trained = looks_trained(model)
    return f"a model loaded by hand ({trained})" if trained else ""


def is_freshly_built(model: nn.Module) -> bool:
    """Whether `model` was built from a config rather than loaded (`loaded_as`), so that weights loaded by hand count
    as loaded too and their trained output role is kept: the head is copied, never drawn over it."""
    return not loaded_as(model)


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
    loaded = loaded_as(model)
    fresh = not loaded
    if policy == "fresh-untied":
        if not fresh:
            reason = f"{loaded}: untie_at / untie_when as set ('fresh-untied' decides for a model built fresh)"
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
            else f"{loaded}: the head starts as a copy of the embedding"
        )
        reason = (
            f"at {limit:.0%} or more, a tied phase cost more than it saved on every budget the decision map measured; "
            f"{start} (head_init). policy='off' runs untie_at / untie_when as set"
        )
        return PolicyChoice(policy, "untied from the start", reason, share, total, "model" if fresh else "copy")
    reason = f"under {limit:.0%}: tie, then untie by the trigger or at the deadline (untie_at / untie_when)"
    return PolicyChoice(policy, "as set", reason, share, total)
