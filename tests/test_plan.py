"""`untie.decision.plan.plan_structure`: every (model, settings, checkpoint) case a run can start or resume from, as a
table."""

from __future__ import annotations

import re

import pytest

from untie.decision.plan import ModelFacts, RunSettings, SavedFacts, plan_structure

CALLBACK = RunSettings("UntieCallback")
UNTIE_AT_ZERO = RunSettings("UntieCallback", untie_at=0)
EMULATING = RunSettings("UntieCallback", tying_mode="emulated")
TIE_FROM_INPUT = RunSettings("UntieCallback", tie_init="input")
EMULATING_TIE = RunSettings("UntieCallback", tying_mode="emulated", tie_init="mean")
ASKED_LIVE = RunSettings("UntieCallback", asked_mode="live")
LOOP = RunSettings("Untier", untie_at=4)
AT_ZERO = RunSettings("Untier", untie_at=0)

TIED, UNTIED, EMULATED = ModelFacts("tied"), ModelFacts("untied"), ModelFacts("emulated")
MARKED = ModelFacts("untied", marked_untied=True)
TIED_BUILT, UNTIED_BUILT = ModelFacts("tied", optimizer_built=True), ModelFacts("untied", optimizer_built=True)
TIED_WRAPPED = ModelFacts("tied", optimizer_built=True, distributed=True)

UNTIED_CKPT = SavedFacts("checkpoint-9", untied=True)
LIVE_CKPT = SavedFacts("checkpoint-9", untied=False, head_stored=False)
EMULATED_CKPT = SavedFacts("checkpoint-9", untied=False, head_stored=True)
SILENT_CKPT = SavedFacts("checkpoint-9", untied=None)
SHARDED_CKPT = SavedFacts("checkpoint-9", untied=False, head_stored=None)

# (case, model, settings, saved, expected target, untie reason, warning/refusal pattern, refused)
CASES = [
    # -- the start of a run ----------------------------------------------------------------------------------------
    ("tied model, defaults", TIED, CALLBACK, None, "tied", None, None, False),
    ("untied model, defaults: kept untied, said", UNTIED, CALLBACK, None, "untied", "start", "trains untied", False),
    ("untied model, tie_init set: tied, said", UNTIED, TIE_FROM_INPUT, None, "tied", None, "tying it", False),
    ("untie_at=0 trains untied", TIED, UNTIE_AT_ZERO, None, "untied", "start", None, False),
    ("a reloaded untie stays untied", MARKED, CALLBACK, None, "untied", "start", None, False),
    ("FSDP2 emulates the tied phase", TIED, EMULATING, None, "emulated", None, None, False),
    ("untied model under FSDP2, defaults: untied", UNTIED, EMULATING, None, "untied", "start", "arrived", False),
    ("untied model under FSDP2, tie_init: emulated", UNTIED, EMULATING_TIE, None, "emulated", None, "tying", False),
    ("optimizer built, no change needed", TIED_BUILT, LOOP, None, "tied", None, None, False),
    (
        "optimizer built without the emulated head",
        TIED_BUILT,
        RunSettings("Untier", tying_mode="emulated"),
        None,
        None,
        None,
        r"emulated tying.*Create the Untier before the optimizer",
        True,
    ),
    # an optimizer built for the tied model: the head joins it now, or (under a wrapper) at the start of training
    ("optimizer built before untie_at=0: the head joins it", TIED_BUILT, AT_ZERO, None, "untied", "start", None, False),
    ("optimizer and wrapper built, a copy at step 0: at start", TIED_WRAPPED, AT_ZERO, None, None, None, None, False),
    (
        "optimizer and wrapper built, a drawn head at step 0",
        TIED_WRAPPED,
        RunSettings("Untier", untie_at=0, draws_head=True),
        None,
        None,
        None,
        r"a head of its own drawn by the model's initialiser.*or pass head_init='copy'",
        True,
    ),
    # -- a resume --------------------------------------------------------------------------------------------------
    ("untied checkpoint into a tied model", TIED, CALLBACK, UNTIED_CKPT, "untied", "checkpoint", None, False),
    ("untied checkpoint into an emulating run", EMULATED, EMULATING, UNTIED_CKPT, "untied", "checkpoint", None, False),
    ("untied checkpoint, optimizer built", TIED_BUILT, LOOP, UNTIED_CKPT, "untied", "checkpoint", None, False),
    ("live checkpoint, live run", TIED, CALLBACK, LIVE_CKPT, "tied", None, None, False),
    ("live checkpoint, untie_at=0 model: tied again", UNTIED, UNTIE_AT_ZERO, LIVE_CKPT, "tied", None, None, False),
    (
        "live checkpoint into an untie_at=0 loop whose optimizer exists",
        UNTIED_BUILT,
        RunSettings("Untier", untie_at=0),
        LIVE_CKPT,
        None,
        None,
        r"untied the model before it started \(untie_at=0\)",
        True,
    ),
    (
        "live checkpoint into an emulating run",
        EMULATED,
        EMULATING,
        LIVE_CKPT,
        None,
        None,
        "live tying.*this run emulates",
        True,
    ),
    ("emulated checkpoint, tying_mode='auto': emulated", TIED, CALLBACK, EMULATED_CKPT, "emulated", None, None, False),
    ("emulated checkpoint, emulating run", EMULATED, EMULATING, EMULATED_CKPT, "emulated", None, None, False),
    (
        "emulated checkpoint, tying_mode='live' asked",
        TIED,
        ASKED_LIVE,
        EMULATED_CKPT,
        None,
        None,
        r"emulated tying.*tying_mode='live'.*UntieCallback\(tying_mode='emulated'\)",
        True,
    ),
    (
        "emulated checkpoint into a live loop whose optimizer exists",
        TIED_BUILT,
        LOOP,
        EMULATED_CKPT,
        None,
        None,
        r"this run ties live.*Create the Untier with tying_mode='emulated'",
        True,
    ),
    ("a checkpoint that does not say: left to the load guard", TIED, CALLBACK, SILENT_CKPT, None, None, None, False),
    ("a sharded tied-phase checkpoint: left as is", EMULATED, EMULATING, SHARDED_CKPT, None, None, None, False),
]


@pytest.mark.parametrize(
    ("model", "settings", "saved", "target", "reason", "message", "refused"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_the_plan_of_each_case(model, settings, saved, target, reason, message, refused):
    plan = plan_structure(model, settings, saved)
    assert plan.target == target
    assert plan.untie_reason == reason
    assert (plan.refusal is not None) == refused
    text = plan.refusal if refused else plan.warning
    if message is None:
        assert text is None
    else:
        assert text is not None
        assert re.search(message, text), text


def test_a_peft_model_keeps_its_structure_and_is_checked():
    peft = ModelFacts("untied", peft=True, config_says_untied=True)
    assert plan_structure(peft, CALLBACK).check_peft
    assert plan_structure(peft, CALLBACK).target is None
    assert plan_structure(peft, CALLBACK).keep_untied  # as without PEFT: an untied model stays untied (issue 59)
    assert not plan_structure(peft, TIE_FROM_INPUT).keep_untied  # a tie asked for: check_peft_run refuses it
    assert plan_structure(peft, UNTIE_AT_ZERO).keep_untied
    assert plan_structure(peft, CALLBACK, UNTIED_CKPT).keep_untied


def test_only_call_order_refusals_are_runtime_errors():
    built = plan_structure(TIED_BUILT, RunSettings("Untier", tying_mode="emulated"))
    live_asked = plan_structure(TIED, ASKED_LIVE, EMULATED_CKPT)
    assert built.call_order and not live_asked.call_order


def test_a_tied_phase_checkpoint_overrides_an_untie_the_default_plan_made_before_it_was_known():
    live = SavedFacts("ckpt", untied=False, head_stored=False)
    untied_built = ModelFacts("untied", optimizer_built=True)
    by_default = RunSettings("Untier", untie_at=0, untied_by_default=True)
    plan = plan_structure(untied_built, by_default, live)
    assert plan.target == "tied" and plan.drop_head and plan.refusal is None
    wrapped = plan_structure(ModelFacts("untied", optimizer_built=True, distributed=True), by_default, live)
    assert wrapped.target is None and "policy='off'" in wrapped.refusal  # a wrapper holds the head: the fix is named
    asked = plan_structure(untied_built, RunSettings("Untier", untie_at=0), live)  # the user's untie_at=0: refused
    assert asked.target is None and "untie_at=0" in asked.refusal
