"""`scripts/quick_start.py`: the README's two lines, as CI runs them in a fresh venv, and the first line's verdict."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from script_modules import load_script

pytestmark = pytest.mark.recipes  # a test of recipes/, scripts/ or the docs' tables (pytest -m 'not recipes')

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def quick_start():
    return load_script("scripts", "quick_start")


def test_the_readme_has_two_lines_one_runs_the_main_job_one_the_tests(quick_start):
    first, second = quick_start.quick_start_lines()
    assert first.startswith("pip install torch==2.13.0 && ") and first.endswith("python recipes/exor.py")
    assert '-e ".[test]"' in second and second.endswith("python -m pytest")  # the suite's command, as CI runs it


def test_ci_runs_both_lines_exactly_in_a_fresh_venv_and_nothing_it_installs_reaches_them():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python -m venv .ci-fresh\n" in ci  # no --system-site-packages: the lines install what they need
    assert 'PATH="$PWD/.ci-fresh/bin:$PATH"' in ci and "scripts/quick_start.py --run 1 2" in ci
    assert ci.index("scripts/quick_start.py --run 1 2") < ci.index("docs_tables.py --check")


def test_a_readme_without_exactly_two_lines_is_refused(quick_start, tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\n## Quick start\n\n```bash\npip install -e .\n```\n\n## Next\n")
    with pytest.raises(ValueError, match="exactly two command lines, found 1"):
        quick_start.quick_start_lines(readme)


def _results(tmp_path: Path, *verdicts) -> Path:
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"claims": [{"claim": f"c{i}", "holds": v} for i, v in enumerate(verdicts)]}))
    return path


def test_the_first_line_passes_only_if_it_checked_a_claim(quick_start, tmp_path, capsys):
    quick_start.check_claims(_results(tmp_path, True, None, True))
    quick_start.check_claims(_results(tmp_path, True, False, None))  # the docs' table says which; CI compares it
    assert "1 of 2 checked claims hold; failing: ['c1']" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no claim was checked"):
        quick_start.check_claims(_results(tmp_path, None, None))
    with pytest.raises(SystemExit, match="was not written"):
        quick_start.check_claims(tmp_path / "missing.json")
