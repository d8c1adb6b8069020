"""The untie policies' rules, pure: what a policy chooses (`choose`) from what was read off the model
(`PolicyReading`), and how a checkpoint's tied run settles it (`settle`). Plain values in, a plain value out: no
torch (a test imports this module with torch blocked), so that the run's one decision (`untie.decision.decide`)
is importable and testable without it. What the policies are, and why: `untie.structure.policy`, which reads the
model (`read_for_policy`) and re-exports these names."""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass
from typing import Literal

from untie.decision import share_bands
from untie.decision.plan import SavedFacts
from untie.decision.share_bands import ShareDefault

#: The embedding's share of the parameters at or above which `policy="auto"` trains untied from the first step: the
#: midpoint of 40% (the first map's d 256, where tie-then-untie held its own) and 56% (d 128 x 4, where untied from the
#: start beat the default at every budget in both development seeds), rounded to 5%, by the rule written before those
#: runs ended. Fixed before the held-out validation; see docs/recipes/decision-map.md, "The policy".
UNTIED_FROM_START_SHARE = 0.5
Plan = Literal["as set", "untied from the start", "tied phase"]


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
    own initialiser) for a model built fresh, "copy" of the embedding otherwise."""
    warning: str | None = None
    """Where the weights' evidence and the config's name disagree (`built_fresh`): said once, at attach."""
    untie_at: float | None = None
    """Plan "tied phase" only (policy "by-share"): the fraction of the run the tied phase lasts (no trigger), or None
    where the model stays tied."""
    embedding_lr_scale: float | None = None
    """Policy "by-share" untied from the start only: the input embedding's rate scale the study's choice trains with
    (applied where the user gave none); None: the user's."""

    @property
    def untied_from_start(self) -> bool:
        return self.plan == "untied from the start"

    @property
    def tied_phase(self) -> bool:
        """The policy chose a tied phase of its own (`untie_at`, no trigger) over the settings' schedule."""
        return self.plan == "tied phase"

    def to_dict(self) -> dict:
        return asdict(self)

    def message(self) -> str:
        """The reason, with the embedding's share (what `untie inspect` and the run's line say)."""
        share = "" if self.embedding_share is None else f" (embedding {self.embedding_share:.0%} of the parameters)"
        return f"policy {self.policy!r}: {self.plan}{share}: {self.reason}"


def settle(choice: PolicyChoice, saved: SavedFacts | None) -> PolicyChoice:
    """The plan once the checkpoint, if any, is known: a checkpoint whose run was still tied decides over an untie
    before the first step that the policy chose for a fresh start (the resumed run continues its tied phase); a fresh
    start, or a checkpoint saved untied, keeps the choice. Pure: both adapters decide with it."""
    if saved is None or saved.untied is not False:
        return choice
    if saved.policy_phase is not None and (choice.untied_from_start or choice.tied_phase):
        (untie_at,) = saved.policy_phase  # the checkpoint's run followed its policy's tied phase: it continues it
        reason = f"{saved.where}: the checkpoint's run was still in the tied phase its policy chose, so it continues it"
        return dataclasses.replace(
            choice, plan="tied phase", reason=reason, head_init="copy", untie_at=untie_at, embedding_lr_scale=None
        )
    if not choice.untied_from_start:
        return choice
    reason = (
        f"{saved.where}: the checkpoint's run was still tied, so it continues its tied phase (the default plan trains "
        "untied from step 0 only a fresh run, not a saved one)"
    )
    return dataclasses.replace(choice, plan="as set", reason=reason, head_init="copy")


@dataclass(frozen=True)
class Freshness:
    """Whether a run counts its model as built fresh (`built_fresh`), why, and a warning to give."""

    fresh: bool
    why: str
    warning: str | None = None


@dataclass(frozen=True)
class PolicyReading:
    """What a policy reads off the model (`read_for_policy`), for `choose` to decide from: read once, at attach."""

    share: float
    """The input embedding's share of the parameters (`embedding_share`)."""
    parameters: int
    freshness: Freshness | None
    """Whether it counts as built fresh (`built_fresh`); None where it arrived untied (nothing to vouch for)."""


def choose(
    policy: str,
    *,
    tied: bool,
    peft: bool,
    reading: PolicyReading | None,
    threshold: float | None = None,
    bands: ShareDefault | None = None,
) -> PolicyChoice:
    """The plan for a run under `policy` (`POLICIES`) of a model that arrives `tied` (or wrapped by PEFT), from what
    `read_for_policy` read. Pure.

    Untied from the start, a model built fresh gets a head drawn by its own initialiser: on the decision map's
    development cells a head copied from the embedding trained 0.02-0.28 nat worse than a drawn one, and in the
    study's cell A 0.008 nat worse. A model holding trained weights gets a head that starts as a copy: untied from the
    start under "untie-at-start" (the default), as set under the other policies.
    `threshold`: the share at which the retired "auto" trains untied from the start (`UNTIED_FROM_START_SHARE`).
    `bands`: what "by-share" reads for a model built fresh (default: `untie.decision.share_bands.SHARE_DEFAULT`;
    "untie-at-start"'s plan while they are pending)."""
    if policy == "off":
        return PolicyChoice(policy, "as set", "policy='off' runs the schedule as set")
    if peft:
        return PolicyChoice(policy, "as set", "a PEFT model trains its adapters; the embedding's tying is its base's")
    if reading is None:  # attached under settings that read nothing (a run adopted under the checkpoint's settings)
        return PolicyChoice(policy, "as set", "the model's weights were not read when the run was attached")
    share, total, fresh = reading.share, reading.parameters, reading.freshness
    if not tied or fresh is None:
        return PolicyChoice(
            policy, "as set", "the model arrived untied: no tied phase to choose (tie_init decides)", share, total
        )
    if not fresh.fresh and policy in ("untie-at-start", "by-share"):
        reason = f"{fresh.why}; a loaded tied model unties at once, its head a copy (the study's fine-tuning table)"
        return PolicyChoice(policy, "untied from the start", reason, share, total, "copy", fresh.warning)
    if not fresh.fresh:
        return PolicyChoice(policy, "as set", fresh.why, share, total, warning=fresh.warning)
    limit = UNTIED_FROM_START_SHARE if threshold is None else threshold
    if policy == "auto" and share < limit:
        reason = f"{fresh.why}; under {limit:.0%} of the parameters in the embedding, policy 'auto' runs the schedule"
        return PolicyChoice(policy, "as set", reason, share, total, warning=fresh.warning)
    if policy == "by-share":
        return _by_share(policy, fresh, share, total, bands or share_bands.SHARE_DEFAULT)
    reason = f"{fresh.why}; from scratch, a tied phase cost more than it saved on the decision map"
    return PolicyChoice(policy, "untied from the start", reason, share, total, "model", fresh.warning)


def _by_share(policy: str, fresh: Freshness, share: float, total: int, bands: ShareDefault) -> PolicyChoice:
    """Policy "by-share" for a tied model built fresh: the band of its embedding's share; "untie-at-start"'s plan while
    the bands are pending."""
    band = bands.band(share)
    if band is None:
        reason = (
            f"{fresh.why}; the study's default by embedding share is {bands.status}, so it trains untied from step 0 "
            "as 'untie-at-start' does"
        )
        return PolicyChoice(policy, "untied from the start", reason, share, total, "model", fresh.warning)
    reason = f"{fresh.why}; its embedding holds {share:.1%} of the parameters, and {band.describe()}"
    if band.untie_at == 0:
        scale = band.embedding_lr_scale if band.embedding_lr_scale != 1 else None
        plan: Plan = "untied from the start"
        return PolicyChoice(policy, plan, reason, share, total, "model", fresh.warning, embedding_lr_scale=scale)
    return PolicyChoice(policy, "tied phase", reason, share, total, "copy", fresh.warning, band.untie_at)
