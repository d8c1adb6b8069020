"""`untie.decision.decide.decide`: the run's one decision, as rows of plain values (no model, no torch)."""

from __future__ import annotations

import pytest

from untie import UntieConfig, UntieWhen
from untie.decision.decide import PENDING, Facts, Settings, decide
from untie.decision.plan import ModelFacts, SavedFacts
from untie.structure.policy import Freshness, PolicyReading

FRESH = Facts(ModelFacts("tied"), tied=True, reading=PolicyReading(0.8, 1000, Freshness(True, "built fresh")))
TRAINED = Facts(ModelFacts("tied"), tied=True, reading=PolicyReading(0.8, 1000, Freshness(False, "counts as trained")))
DEFAULT = Settings(UntieConfig(), "UntieCallback")
TIED_CHECKPOINT = SavedFacts("checkpoint-4", untied=False, head_stored=False)


def test_a_fresh_model_trains_untied_from_step_0_its_draw_judged_by_the_first_batch():
    decision = decide(FRESH, DEFAULT)
    assert (decision.untie_at, decision.rule, decision.head_init) == (0, None, "model")
    assert decision.judge_first_batch and decision.start.target == "untied" and decision.resume is None
    assert decision.notices == ()  # no trigger runs: the pair-free rule is not announced


def test_while_the_checkpoint_is_unknown_the_untie_waits_and_nothing_is_drawn():
    decision = decide(FRESH, DEFAULT, PENDING)
    assert decision.waits and not decision.untied_from_start
    assert decision.start.target == "tied" and not decision.judge_first_batch and decision.notices == ()


def test_a_tied_checkpoint_continues_its_tied_phase_with_a_copied_head_and_says_the_pair_free_rule():
    decision = decide(FRESH, DEFAULT, TIED_CHECKPOINT, step=4)
    assert decision.choice.plan == "as set" and "continues its tied phase" in decision.choice.reason
    assert (decision.untie_at, decision.head_init, decision.judge_first_batch) == (0.3, "copy", False)
    assert decision.rule.signal == "cancellation" and "pair-free rule" in decision.notices[0]
    assert decision.start.target == "tied" and decision.resume.target == "tied"


def test_a_model_that_counts_as_trained_is_never_drawn_over():
    decision = decide(TRAINED, DEFAULT)  # the default: untied at once, the head a copy
    assert (decision.choice.plan, decision.untie_at, decision.head_init) == ("untied from the start", 0, "copy")
    assert decision.start.target == "untied" and not decision.judge_first_batch and decision.rule is None
    former = decide(TRAINED, Settings(UntieConfig(policy="fresh-untied"), "UntieCallback"))  # tied first, a copy
    assert (former.choice.plan, former.untie_at, former.head_init) == ("as set", 0.3, "copy")
    assert former.start.target == "tied" and not former.judge_first_batch


def test_the_first_batchs_verdict_is_a_fact_the_decision_follows():
    judged = Facts(FRESH.model, True, FRESH.reading, first_batch=("copy", "the copy predicts better by 1.7 nat"))
    decision = decide(judged, DEFAULT)
    assert decision.head_init == "copy" and not decision.judge_first_batch
    assert decision.choice.reason.startswith("at the first batch, the copy predicts better")
    kept = decide(Facts(FRESH.model, True, FRESH.reading, first_batch=("model", "-0.001 nat")), DEFAULT)
    assert kept.head_init == "model" and kept.choice.reason.endswith("at the first batch, -0.001 nat")


@pytest.mark.parametrize(
    ("facts", "step", "judged"),
    [(FRESH, 0, True), (FRESH, 3, False), (Facts(FRESH.model, True, FRESH.reading, head_replaceable=False), 0, False)],
)
def test_only_a_drawn_head_the_first_forward_can_still_replace_is_judged(facts, step, judged):
    assert decide(facts, DEFAULT, step=step).judge_first_batch is judged


def test_your_word_draws_as_asked_and_a_setting_the_plan_does_not_use_is_named():
    scratch = decide(TRAINED, Settings(UntieConfig(from_scratch=True), "Untier"))
    assert scratch.head_init == "model" and not scratch.judge_first_batch  # from_scratch=True: drawn as asked
    unused = decide(TRAINED, Settings(UntieConfig(head_init="model"), "Untier"))
    assert unused.head_init == "model"  # the default unties it at once: drawn as asked, over trained weights, said
    assert "head_init='model' draws the head over a model that counts as trained" in unused.warnings[0][0]
    former = decide(TRAINED, Settings(UntieConfig(head_init="model", policy="fresh-untied"), "Untier"))
    assert "head_init='model' draws a head untied before the first step" in former.warnings[0][0]
    off = decide(FRESH, Settings(UntieConfig(untie_at=10, from_scratch=False), "Untier"))
    assert "from_scratch=False changes nothing here" in off.warnings[0][0]
    tie_init = decide(TRAINED, Settings(UntieConfig(tie_init="mean"), "Untier"))
    assert "tie_init='mean' changes nothing here: the model arrived tied" in tie_init.warnings[0][0]
    assert (
        decide(Facts(ModelFacts("untied"), tied=False), Settings(UntieConfig(tie_init="mean"), "Untier")).warnings == ()
    )


def test_a_retired_policy_warns_and_a_per_pair_rule_without_pairs_is_refused():
    retired = decide(FRESH, Settings(UntieConfig(policy="auto"), "Untier"))
    assert retired.warnings[0][1] is FutureWarning
    per_pair = UntieWhen(signal="gap", threshold=1.5)
    refused = decide(TRAINED, Settings(UntieConfig(untie_when=per_pair, untie_at=None), "Untier"))
    assert "reads pairs, and there are none" in refused.refusal
    measured = Facts(TRAINED.model, True, TRAINED.reading, pairs=True)
    assert decide(measured, Settings(UntieConfig(untie_when=per_pair, untie_at=None), "Untier")).refusal is None


def test_a_custom_loop_that_drew_before_a_tied_state_loads_drops_the_unused_draw_with_the_optimizer():
    drawn = Facts(ModelFacts("untied", optimizer_built=True), tied=True, reading=FRESH.reading)
    decision = decide(drawn, Settings(UntieConfig(), "Untier"), TIED_CHECKPOINT)
    assert decision.resume.target == "tied" and decision.resume.drop_head


def test_tie_init_ties_a_checkpoint_this_library_untied():
    marked = Facts(ModelFacts("untied", marked_untied=True), tied=False)
    assert decide(marked, DEFAULT).start.target == "untied"
    assert decide(marked, Settings(UntieConfig(tie_init="mean"), "UntieCallback")).start.target == "tied"


def test_the_decision_and_its_rules_import_without_torch():
    """The run's one decision is pure: every module of `untie.decision` (the decision, the policy's rules, the structure
    plans, the settings and the run's lines) imports in a process where torch cannot be imported."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import pkgutil, importlib, untie.decision\n"
        "for module in pkgutil.iter_modules(untie.decision.__path__):\n"
        "    importlib.import_module(f'untie.decision.{module.name}')\n"
        "assert 'torch' not in {m.split('.')[0] for m in sys.modules if sys.modules[m] is not None}\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
