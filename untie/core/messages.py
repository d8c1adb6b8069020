"""How a run says what `untie.decision.lines` words: once each (`say_once`), as a warning in the user's code or a
logged line. The texts come from the run's values (`untie.decision.lines.RunSummary`, which
`untie.core.run.UntieRun.summary` makes); this module only chooses how each is said."""

from __future__ import annotations

import logging

from untie import _compat
from untie.decision import lines
from untie.decision.lines import RunSummary

logger = logging.getLogger(__name__)


def say_once(said: set[str], texts) -> None:
    """Say each of `texts` ((text, warning category) pairs; category None: a logged warning) not in `said` yet (a
    run's record: each once per run), in the user's code."""
    for text, category in texts:
        if text not in said:
            said.add(text)
            if category is None:
                logger.warning(text)
            else:
                _compat.warn_in_user_code(text, category)


def announce(run: RunSummary, said: set[str], step: int, max_steps: int | None) -> str:
    """Say what the run begun at `step` will do, in one line in its own numbers (`lines.plan_line`, with the per-role
    rates; returned, the run keeps it in its state): a warning where a policy decided, a note where the schedule was
    set; where a trigger runs, whether it can fire in the run (`lines.short_run_notice`) and the decision's notices
    (once each: `said`)."""
    line = lines.plan_line(run, step, max_steps)
    line = f"{line}; {run.rates.removeprefix('untie: ')}" if run.rates else line
    decided = run.decision is not None and run.decision.choice.policy != "off"
    logger.log(logging.WARNING if decided else logging.INFO, line)
    short = lines.short_run_notice(run, step, max_steps) if run.measuring else None
    if short is not None:
        text, warns = short
        if warns:
            _compat.warn_in_user_code(text)
        else:
            logger.info(text)
    if run.decision is not None and run.rule is not None and run.measuring:
        say_once(said, [(notice, None) for notice in run.decision.notices])
    return line


def warn_changed_settings(run: RunSummary, saved_config: dict, step: int) -> None:
    """Warn, in the user's code, where a resume runs under other schedule settings than its checkpoint's
    (`lines.changed_settings`)."""
    changed = lines.changed_settings(run, saved_config, step)
    if changed is not None:
        _compat.warn_in_user_code(changed)


def end_of_run(run: RunSummary, said: set[str], trained: bool) -> None:
    """At the run's end (`trained`: it started): a run that ends in an emulated tied phase says that its model holds two
    equal matrices, which save untied, and how to tie them (`lines.ended_tied_emulated_text`), once."""
    if trained and run.emulated and not run.untied:
        say_once(said, [(lines.ended_tied_emulated_text(run.owner), None)])
