"""The structure a run's model must have, decided in one place: `plan_structure`.

A model trains in one of three structures:

* ``"tied"``: one shared parameter (live tying);
* ``"emulated"``: the LM head has its own parameter, kept equal to the embedding and trained with the tied gradient
  (`untie.engines.emulation.EmulatedTying`: FSDP2's tied phase);
* ``"untied"``: two independent parameters.

Which one it needs depends on three things only: what the model is now (`ModelFacts`), the run's settings
(`RunSettings`) and, on resume, what the checkpoint says about the run that wrote it (`SavedFacts`). This module turns
them into a `StructurePlan`: the target structure, the reason an untied target is untied, a warning to give, or a
refusal that names the fix. It is pure (plain values in, a plain value out, no torch), so every case is a row of
`tests/test_plan.py`. The run's decision asks it (`untie.decision.decide.decide`: at a start, and for a checkpoint
about to load), as does `untie.prepare_for_resume`; `untie.core.model_structure.ModelStructure.execute` carries the plan
out on the model (and the optimizer, once it exists).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from untie.decision.settings import TieInit

Structure = Literal["tied", "emulated", "untied"]

#: The first PEFT release whose `merge_and_unload()` records the split that `modules_to_save` makes on a tied model
#: (`tie_word_embeddings=False` once the merged input embedding and LM head are separate matrices). Measured (issue
#: 69, `scripts/peft_tied_merge.py`: a tiny tied Qwen3, LoRA + `modules_to_save` on one or both roles, 5 AdamW steps,
#: transformers 5.24.0): peft 0.18.0 and 0.18.1 keep the flag True, so `tie_weights()` after the merge, or a save and
#: reload, replaces the trained head with the embedding (logits move by 0.6-1.03); peft 0.19.0, 0.19.1, 0.20.0, 0.21.0
#: and 0.21.2 write False, and the merged model keeps both matrices through `tie_weights()` and a reload (logits
#: within 3e-7). peft 0.17 does not import under transformers 5. PEFT writes the top-level config only: a multimodal
#: `text_config` keeps True (Gemma 3), which `untie.untie_embeddings(merged)` records too.
MERGE_RECORDS_THE_SPLIT = "0.19.0"


@dataclass(frozen=True)
class ModelFacts:
    """What the model is, read off it (`untie.structure.facts.model_facts`)."""

    structure: Structure
    marked_untied: bool = False
    """Its config carries this library's untie marker (a checkpoint untied by untie, reloaded)."""
    peft: bool = False
    """A PEFT model (or a transformers model with an adapter): PEFT owns both matrices."""
    config_says_untied: bool = False
    """Its config says untied (the marker or ``tie_word_embeddings=False``); read for PEFT models."""
    peft_split: tuple[str, ...] = ()
    """The roles ("input embedding", "LM head") to which PEFT's `modules_to_save` gave a trainable copy of the tied
    matrix, untying the model when it wrapped it; () where it did not (read for an untied PEFT model whose config does
    not say so)."""
    sharded: bool = False
    """Its embedding is already sharded (FSDP2's `fully_shard` ran): no parameter can be added any more."""
    optimizer_built: bool = False
    """The optimizer (and any wrapper) exists: a change that adds or removes a parameter can no longer happen, but
    where nothing wraps the model (`distributed` False) and no step has run: then the optimizer is changed too."""
    distributed: bool = False
    """More than one process trains it (DDP, FSDP2, DeepSpeed): a wrapper may hold its parameters."""


@dataclass(frozen=True)
class RunSettings:
    """The settings that decide the structure (from `untie.UntieConfig` and the training engine)."""

    adapter: str
    """The adapter's name, as users wrote it ("UntieCallback", "Untier"): messages name it."""
    untie_at: int | float | None = 0.3
    """`untie_at` as set: 0 trains untied from the first step."""
    tying_mode: Literal["live", "emulated"] = "live"
    """The tied phase's implementation resolved for the engine."""
    asked_mode: Literal["live", "emulated", "auto"] = "auto"
    """`tying_mode` as the user set it: "auto" follows a checkpoint's mode."""
    tie_init: TieInit | None = None
    """How a model that arrives untied is tied; None: it is not, it trains untied (nothing trained is dropped)."""
    untied_by_default: bool = False
    """The run untied the model before its first step by the default plan alone (`UntieConfig.chosen_policy`: the
    user set no schedule): a checkpoint of a run that was still tied decides instead."""
    draws_head: bool = False
    """A head untied before the first step is drawn by the model's initialiser; False: it starts as a copy of the
    embedding. Under a distributed wrapper built before the run attached, only a copy can join the optimizer (an
    untie at the start of training)."""

    @property
    def untie_at_zero(self) -> bool:
        return self.untie_at == 0 and not isinstance(self.untie_at, bool)


@dataclass(frozen=True)
class SavedFacts:
    """What a checkpoint says about the run that wrote it, read before anything loads."""

    where: str
    """The folder or file, for messages."""
    untied: bool | None
    """The run was untied when it saved (None: the checkpoint does not say)."""
    head_stored: bool | None = None
    """In the tied phase: the LM head has its own tensor (emulated tying). None: not read (FSDP's sharded format)."""
    lr_groups: tuple[str, ...] | None = None
    """The roles that had an optimizer param group of their own (`untie.structure.role_rates`); None: not recorded
    (a checkpoint written without them, or before they existed)."""
    policy_phase: tuple[float | None] | None = None
    """The checkpoint's run followed a tied phase its policy chose itself ("by-share"): ``(untie_at,)``, a fraction of
    the run (None: it stays tied); None where it did not (or the checkpoint does not say)."""


def saved_policy_phase(attributes: Any) -> tuple[float | None] | None:
    """`SavedFacts.policy_phase` from a run state's attributes (`UntieRun.state_attributes`): its policy's choice, where
    that was a tied phase of the policy's own ("by-share")."""
    policy = attributes.get("policy") if isinstance(attributes, dict) else None
    if not isinstance(policy, dict) or policy.get("plan") != "tied phase":
        return None
    untie_at = policy.get("untie_at")
    return (float(untie_at) if untie_at is not None else None,)


@dataclass(frozen=True)
class StructurePlan:
    """What to do with the model: reach `target` (None: leave it as it is), say `warning`, or raise `refusal`."""

    target: Structure | None
    untie_reason: str | None = None
    """Why an untied target is untied: "start" (untie_at=0 or a reloaded untie) or "checkpoint" (resumed)."""
    warning: str | None = None
    refusal: str | None = None
    call_order: bool = False
    """The refusal is about the order of the user's calls (raised as `RuntimeError`), not about the checkpoint or
    the settings (`ValueError`)."""
    tie_init: TieInit = "input"
    """The matrix an untied model is tied from, where the plan ties one."""
    check_peft: bool = False
    """A PEFT model: `untie.structure.peft_support.check_peft_run` decides (with `keep_untied`); the structure stays."""
    keep_untied: bool = False
    drop_head: bool = False
    """The tie drops a head the optimizer already holds (before its first step, nothing wrapping the model): it
    leaves the optimizer too."""


def plan_structure(model: ModelFacts, settings: RunSettings, saved: SavedFacts | None = None) -> StructurePlan:
    """The structure the model must have to start this run (`saved` None) or to resume the run saved in `saved`."""
    if model.peft:
        # As without PEFT: an untied model stays untied unless tie_init asks for a tie (which PEFT cannot take).
        keep_untied = model.marked_untied or settings.untie_at_zero or bool(saved and saved.untied)
        keep_untied = keep_untied or (model.structure == "untied" and settings.tie_init is None)
        return StructurePlan(None, check_peft=True, keep_untied=keep_untied)
    if saved is None:
        return _plan_start(model, settings)
    if saved.untied:
        return StructurePlan("untied", untie_reason="checkpoint")
    if saved.untied is None or saved.head_stored is None:
        return StructurePlan(None)  # the checkpoint does not say: the load guard matches what the weights hold
    if saved.head_stored:
        return _plan_emulated_checkpoint(model, settings, saved)
    return _plan_live_checkpoint(model, settings, saved)


def _plan_start(model: ModelFacts, settings: RunSettings) -> StructurePlan:
    if (model.marked_untied and settings.tie_init is None) or settings.untie_at_zero:
        # A checkpoint untie untied (T5/BART re-tie on reload at equal values) or an untie at step 0: untied from the
        # start. On an already-untied model this only re-applies the bookkeeping a reload loses. tie_init, set, ties
        # a checkpoint this library untied as it ties any untied model (below).
        plan = StructurePlan("untied", untie_reason="start")
    elif model.structure == "untied" and settings.tie_init is None:
        # Its head is a trained matrix of its own: a default run never drops it. Tying it is a setting.
        plan = StructurePlan(
            "untied",
            untie_reason="start",
            warning=(
                f"{settings.adapter}: the model arrived untied (its LM head is a matrix of its own), so it trains "
                "untied from the first step and nothing is tied or dropped. To tie it first and untie it later, pass "
                "tie_init='input', 'output' or 'mean' (the matrix the tied phase starts from)."
            ),
        )
    else:
        warning = None
        if model.structure == "untied":
            warning = (
                f"{settings.adapter}: the model arrived untied; tying it with tie_init={settings.tie_init!r} (the "
                "other matrix is dropped). To keep it untied, leave tie_init=None."
            )
        target: Structure = "emulated" if settings.tying_mode == "emulated" else "tied"
        plan = StructurePlan(target, warning=warning, tie_init=settings.tie_init or "input")
    if model.sharded and model.structure == "tied" and plan.target == "emulated":
        return StructurePlan(
            None,
            refusal=(
                f"{settings.adapter}: the model is already sharded (fully_shard / accelerator.prepare) and still tied: "
                "emulated tying gives the head its own parameter before sharding. Create the "
                f"{settings.adapter} before fully_shard, before building the optimizer and before accelerator.prepare; "
                "then call untier.start(optimizer)."
            ),
            call_order=True,
        )
    live_untie_at_start = settings.untie_at_zero and settings.tying_mode == "live" and plan.target == "untied"
    if model.optimizer_built and model.structure == "tied" and live_untie_at_start:
        # The optimizer was built for the tied model (Untier(model, optimizer), Trainer(optimizers=...)). Where
        # nothing wraps the model, the head joins it now; else the run unties at the start of training, as a
        # deadline at step 0, and the copied head joins it then (a drawn head cannot: the refusal below).
        if not model.distributed:
            return plan
        if not settings.draws_head:
            return StructurePlan(None)
    if model.optimizer_built and _adds_or_drops_a_parameter(model.structure, plan.target):
        return StructurePlan(
            None,
            refusal=(
                f"{settings.adapter}: the model needed a new structure before its first step ({_needed(settings)}), "
                "but its optimizer was already built without it. "
                + (
                    "Let Trainer build the optimizer (leave optimizers=... out)"
                    if settings.adapter == "UntieCallback"
                    else "Create the Untier before the optimizer (and before accelerator.prepare / DDP / fully_shard), "
                    "then call untier.start(optimizer)"
                )
                + (
                    ", or pass head_init='copy' (a copied head can join a built optimizer)."
                    if settings.draws_head and settings.tying_mode == "live"
                    else "."
                )
            ),
            call_order=True,
        )
    return plan


def _plan_emulated_checkpoint(model: ModelFacts, settings: RunSettings, saved: SavedFacts) -> StructurePlan:
    """A tied-phase checkpoint with a separate head: written with emulated tying (FSDP2's default, or asked for)."""
    if model.structure == "emulated":
        return StructurePlan("emulated")
    if model.structure == "untied" and settings.untied_by_default:
        return StructurePlan(
            None,
            refusal=(
                f"{settings.adapter}: {saved.where} was written in the tied phase (emulated tying), but the default "
                "plan untied this model before its first step. Create the "
                f"{settings.adapter} with policy='off' (the checkpoint's run continues as set) to resume it."
            ),
        )
    if model.optimizer_built:
        return StructurePlan(
            None,
            refusal=(
                f"{settings.adapter}: the checkpoint was written in the tied phase with emulated tying (a head kept "
                f"equal to the embedding), but this run ties live. Create the {settings.adapter} with "
                "tying_mode='emulated', before the optimizer."
            ),
        )
    if settings.asked_mode == "live":
        return StructurePlan(
            None,
            refusal=(
                f"{saved.where} was written in the tied phase with emulated tying (a head kept equal to the embedding, "
                f"FSDP2's mode), but this run asks for tying_mode='live'. Resume it with {settings.adapter}("
                "tying_mode='emulated') or tying_mode='auto' (which follows the checkpoint)."
            ),
        )
    return StructurePlan("emulated")


def _plan_live_checkpoint(model: ModelFacts, settings: RunSettings, saved: SavedFacts) -> StructurePlan:
    """A tied-phase checkpoint with one shared matrix: written with live tying."""
    if model.structure == "emulated":
        return StructurePlan(
            None,
            refusal=(
                f"{saved.where} was written in the tied phase with live tying (one shared matrix), but this run "
                "emulates tying (FSDP2, or tying_mode='emulated'): its optimizer state does not fit. Resume it where "
                "live tying runs (one device or DDP) with tying_mode='auto' or 'live'."
            ),
        )
    if model.structure == "untied" and model.optimizer_built:
        if settings.untied_by_default and not model.distributed:
            # The default plan was made before the checkpoint was known: the checkpoint's run decides (Trainer's way).
            dropped = (
                f"{settings.adapter}: {saved.where} was saved in its tied phase, so this run continues it tied: the "
                f"head the default made at {settings.adapter}() for a fresh start (drawn or copied, never trained) is "
                "dropped, with its place in the optimizer, before the first step. Pass policy='off' when resuming a "
                "tied-phase checkpoint to skip it."
            )
            return StructurePlan("tied", tie_init="input", drop_head=True, warning=dropped)
        if settings.untied_by_default:
            return StructurePlan(
                None,
                refusal=(
                    f"{settings.adapter}: the checkpoint was written in the tied phase, but the default plan untied "
                    "this model before its first step, and a distributed run's optimizer now holds its head. Create "
                    f"the {settings.adapter} with policy='off' (the checkpoint's run continues as set) to resume it."
                ),
            )
        return StructurePlan(
            None,
            refusal=(
                f"{settings.adapter}: the checkpoint was written in the tied phase, but this run untied the model "
                f"before it started (untie_at={settings.untie_at}). Resume it with the "
                "checkpoint run's untie_at."
            ),
        )
    # An untie_at=0 model is tied again so that the checkpoint loads; the deadline unties it at the resume step.
    return StructurePlan("tied", tie_init="input")


def _needed(settings: RunSettings) -> str:
    """The structure a start needs, in words (for the call-order refusal)."""
    if settings.untie_at_zero:
        return "a head of its own drawn by the model's initialiser" if settings.draws_head else "a head of its own"
    return f"{settings.tying_mode} tying, untie_at={settings.untie_at}"


def _adds_or_drops_a_parameter(current: Structure, target: Structure | None) -> bool:
    """Whether reaching `target` changes the model's parameters (a new head, or a head dropped by a tie)."""
    if target is None or current == target:
        return False
    return not (current == "emulated" and target == "untied")  # a release keeps both parameters
