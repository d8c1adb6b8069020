"""Issue 79, item 4: what a run says is rendered from values (`untie.decision.lines.RunSummary` and the decision),
never from the run object or the model: the run's own line equals the rendering of its summary, the summary holds
only plain values of the decision package, and the same words come out of a process where torch cannot load."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import warnings

import pytest
import torch

import untie
from untie.decision import lines
from untie.testing import ToyLMDataset, tiny_model

#: Types a summary may hold: plain Python values and the decision package's own data.
PLAIN = (str, int, float, bool, type(None))


def _plain(value, path: str = "summary") -> list[str]:
    """Where `value` holds anything but plain values or the decision package's data (a tensor, a module, a run)."""
    if isinstance(value, PLAIN):
        return []
    if isinstance(value, (tuple, list)):
        return [bad for i, item in enumerate(value) for bad in _plain(item, f"{path}[{i}]")]
    if isinstance(value, dict):
        return [bad for key, item in value.items() for bad in _plain(item, f"{path}[{key!r}]")]
    module = type(value).__module__
    if not module.startswith("untie.decision."):
        return [f"{path}: {type(value).__module__}.{type(value).__name__}"]
    if dataclasses.is_dataclass(value):
        fields = [(field.name, getattr(value, field.name)) for field in dataclasses.fields(value)]
        return [bad for name, item in fields for bad in _plain(item, f"{path}.{name}")]
    return []


def _first_step(untier: untie.Untier, model) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    untier.start(optimizer)
    model(**ToyLMDataset(n=2)[:]).loss.backward()  # the run says its plan when its first step begins
    optimizer.step()
    untier.step()


@pytest.mark.parametrize(
    "settings",
    [
        {"untie_at": 4, "untie_when": None},  # a tied phase to a step
        {"untie_at": 0.5, "untie_when": "cancellation"},  # a tied phase under a trigger
        {"untie_at": 0},  # untied from step 0 by the schedule
        {},  # the default
        {"embedding_lr_scale": 4.0, "untie_at": 0},  # with the per-role rates' clause
    ],
    ids=["deadline", "trigger", "untie-at-0", "default", "rates"],
)
def test_the_runs_line_is_the_rendering_of_its_summary_of_plain_values(settings):
    model = tiny_model("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        untier = untie.Untier(model, max_steps=10, **settings)
        _first_step(untier, model)
    summary = untier.run.summary()
    assert not _plain(summary), _plain(summary)
    line = lines.plan_line(summary, 0, 10)
    rates = summary.rates.removeprefix("untie: ") if summary.rates else None
    assert untier.plan == (f"{line}; {rates}" if rates else line)
    untier.close()


def test_a_resume_under_changed_settings_is_worded_from_the_summary():
    """The resume's warning: the same text from the run's load and from `lines.changed_settings` on its summary."""
    model = tiny_model("llama")
    untier = untie.Untier(model, max_steps=10, untie_at=6, untie_when=None)
    _first_step(untier, model)
    state = untier.run.state_dict(1)
    state["adapter"] = "UntieCallback"  # the Trainer adapter's state: it may leave out the weights' fingerprint
    untier.close()

    resumed = untie.core.run.UntieRun(untie.UntieConfig(untie_at=8, untie_when=None))
    resumed.attach(tiny_model("llama"))
    with pytest.warns(UserWarning) as caught:
        resumed.load_state_dict(state, "the saved state", 1)
    said = [str(w.message) for w in caught if "changed settings" in str(w.message)]
    assert said == [lines.changed_settings(resumed.summary(), state["config"], 1)]
    assert "untie_at: 6 -> 8" in said[0] and "pass untie_at=6 (the checkpoint's)" in said[0]


def test_the_lines_render_from_hand_made_values_where_torch_cannot_load():
    """The words need no torch: a summary built by hand in a process with torch blocked renders the plan line, the
    resume's warning and the short-run notice that the run's own code path gives."""
    code = """
import sys; sys.modules['torch'] = None
from untie.decision.lines import RunSummary, plan_line, changed_settings, short_run_notice
from untie.decision.settings import UntieConfig
from untie.decision.triggers import UntieWhen
config = UntieConfig(untie_at=0.5, untie_when='cancellation', metrics_every=50)
rule = UntieWhen.coerce('cancellation')
run = RunSummary('Untier', config, None, 0.5, deadline_step=40, rule=rule, warmup_step=8, measuring=True)
print(plan_line(run, 0, 80))
print(changed_settings(run, {'untie_at': 0.3, 'untie_when': 'cancellation'}, 12))
print(short_run_notice(run, 0, 80))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    plan, changed, notice = result.stdout.splitlines()
    assert plan == (
        "untie: trains tied; unties when the divergence trigger (cancellation) fires, at step 40 (untie_at=0.5 of 80) "
        "at the latest; the head starts as a copy of the embedding"
    )
    assert changed.startswith("Untier: resumed at step 12 with changed settings (untie_at: 0.3 -> 0.5)")
    assert "metrics_every=50 leaves the divergence trigger 0 measurement(s)" in notice and "True)" in notice


def test_at_the_first_step_the_plan_then_the_short_run_note_then_the_rules_notice(caplog):
    """The order the lines come in at the first step, as before they were worded from values: the plan line, the
    trigger's too-short run, then the decision's notice that the default rule reads no pairs."""
    import logging

    model = tiny_model("llama")
    with warnings.catch_warnings(), caplog.at_level(logging.INFO, logger="untie"):
        warnings.simplefilter("ignore")
        untier = untie.Untier(model, max_steps=8, policy="off", untie_at=4, metrics_every=50)
        _first_step(untier, model)
    said = [r.getMessage() for r in caplog.records]
    plan = next(i for i, text in enumerate(said) if text.startswith("untie: trains tied"))
    short = next(i for i, text in enumerate(said) if "metrics_every=50 leaves the divergence trigger" in text)
    notice = next(i for i, text in enumerate(said) if "reads no pairs" in text or "pair-free" in text)
    assert plan < short < notice, said
    untier.close()


@pytest.mark.parametrize(
    ("reason", "words"),
    [("trigger", "when the divergence trigger fired"), ("deadline", "at its deadline"),
     ("checkpoint", "as the checkpoint it resumed from was"), ("start", "before the first step")],
)  # fmt: skip
def test_a_resumed_untied_run_says_why_it_untied_in_words(reason, words):
    """Issue 78: a resumed run's line read "(untied at step 0, checkpoint)", the reason's code name."""
    from untie.decision.settings import UntieConfig

    run = lines.RunSummary("Untier", UntieConfig(), None, None, untie_step=3, untie_reason=reason)
    assert lines.plan_line(run, 10, 20) == f"untie: resumed at step 10: trains untied (untied at step 3, {words})"


def test_the_untie_as_it_happens_says_why_in_the_same_words():
    assert (
        lines.untied_text(3, "deadline")
        == "untie: untied the LM head from the input embedding at step 3 (at its deadline)"
    )
