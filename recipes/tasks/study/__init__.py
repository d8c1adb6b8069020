"""The tie-then-untie study (issue 68, recipes/study.py): its protocol, model, runs, trigger watch, sweep, report."""
